package main

// Values as Helm 3 builds them: the chart's values.yaml, then each -f file, then --set, merged
// map by map (a null deletes a key); numbers from files become float64, as with Helm's
// YAML -> JSON decoding. The result is checked against values.schema.json when the chart has one.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/xeipuuv/gojsonschema"
	"gopkg.in/yaml.v2"
)

func loadValues(chartDir string, files, sets []string) (map[string]interface{}, error) {
	values, err := readValuesFile(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		return nil, err
	}
	for _, file := range files {
		override, err := readValuesFile(file)
		if err != nil {
			return nil, err
		}
		values = merge(values, override)
	}
	for _, set := range sets {
		override, err := parseSet(set)
		if err != nil {
			return nil, err
		}
		values = merge(values, override)
	}
	return values, nil
}

func readValuesFile(path string) (map[string]interface{}, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var doc interface{}
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	doc, err = jsonNormalize(stringKeys(doc))
	if err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	if doc == nil {
		return map[string]interface{}{}, nil
	}
	values, ok := doc.(map[string]interface{})
	if !ok {
		return nil, fmt.Errorf("%s: values must be a mapping", path)
	}
	return values, nil
}

// stringKeys turns yaml.v2's map[interface{}]interface{} into JSON-shaped maps.
func stringKeys(v interface{}) interface{} {
	switch t := v.(type) {
	case map[interface{}]interface{}:
		out := make(map[string]interface{}, len(t))
		for k, val := range t {
			out[fmt.Sprint(k)] = stringKeys(val)
		}
		return out
	case []interface{}:
		for i := range t {
			t[i] = stringKeys(t[i])
		}
	}
	return v
}

// jsonNormalize round-trips through encoding/json, as Helm's sigs.k8s.io/yaml does.
func jsonNormalize(v interface{}) (interface{}, error) {
	raw, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var out interface{}
	err = json.Unmarshal(raw, &out)
	return out, err
}

// merge returns base overlaid with override; maps merge recursively, a nil deletes the key.
func merge(base, override map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(base))
	for k, v := range base {
		out[k] = v
	}
	for k, v := range override {
		if v == nil {
			delete(out, k)
			continue
		}
		baseMap, baseIsMap := out[k].(map[string]interface{})
		overMap, overIsMap := v.(map[string]interface{})
		if baseIsMap && overIsMap {
			out[k] = merge(baseMap, overMap)
		} else {
			out[k] = v
		}
	}
	return out
}

// parseSet reads "a.b=v,c=w" (no list indexes) with Helm's scalar typing: int64, bool, null
// or string.
func parseSet(expr string) (map[string]interface{}, error) {
	out := map[string]interface{}{}
	for _, pair := range strings.Split(expr, ",") {
		key, raw, ok := strings.Cut(pair, "=")
		if !ok || key == "" || strings.ContainsAny(key, "[]") {
			return nil, fmt.Errorf("--set %q: want key.path=value (list indexes unsupported)", pair)
		}
		var value interface{} = raw
		if n, err := strconv.ParseInt(raw, 10, 64); err == nil {
			value = n
		} else if raw == "true" || raw == "false" {
			value = raw == "true"
		} else if raw == "null" {
			value = nil
		}
		parts := strings.Split(key, ".")
		node := out
		for _, part := range parts[:len(parts)-1] {
			child, ok := node[part].(map[string]interface{})
			if !ok {
				child = map[string]interface{}{}
				node[part] = child
			}
			node = child
		}
		node[parts[len(parts)-1]] = value
	}
	return out, nil
}

// validateSchema fails like Helm when the values break the chart's values.schema.json.
func validateSchema(chartDir string, values map[string]interface{}) error {
	path := filepath.Join(chartDir, "values.schema.json")
	raw, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil
	} else if err != nil {
		return err
	}
	result, err := gojsonschema.Validate(
		gojsonschema.NewBytesLoader(raw), gojsonschema.NewGoLoader(values))
	if err != nil {
		return fmt.Errorf("values.schema.json: %v", err)
	}
	if result.Valid() {
		return nil
	}
	var msg strings.Builder
	msg.WriteString("values don't meet the specifications of the schema(s) in the following chart(s):\n")
	msg.WriteString(filepath.Base(filepath.Clean(chartDir)) + ":\n")
	for _, e := range result.Errors() {
		fmt.Fprintf(&msg, "- %s\n", e)
	}
	return fmt.Errorf("%s", strings.TrimRight(msg.String(), "\n"))
}
