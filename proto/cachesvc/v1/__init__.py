"""Generated gRPC modules of the cachesvc wire contract; see proto/README.md."""
