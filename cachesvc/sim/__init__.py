"""The capacity-planning simulator (`cachesvc simulate`): replays a trace through the real
routing policies, block pools and load planner, with time from a cost profile."""
