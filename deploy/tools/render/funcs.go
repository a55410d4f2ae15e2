package main

// Helm's template functions on top of sprig's: include, tpl, required, toYaml/fromYaml,
// fromJson and lookup, with Helm 3's semantics (see README.md for the differences).

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	"gopkg.in/yaml.v2"
)

const maxIncludeDepth = 1000

func funcMap(root *template.Template) template.FuncMap {
	funcs := sprig.TxtFuncMap()
	// Helm removes these: a chart must render the same on every machine.
	delete(funcs, "env")
	delete(funcs, "expandenv")
	depth := map[string]int{}
	funcs["include"] = func(name string, data interface{}) (string, error) {
		if depth[name] >= maxIncludeDepth {
			return "", fmt.Errorf("rendering template has a nested reference name: %s", name)
		}
		depth[name]++
		defer func() { depth[name]-- }()
		var buf strings.Builder
		err := root.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		clone, err := root.Clone()
		if err != nil {
			return "", err
		}
		t, err := clone.New("tpl").Parse(text)
		if err != nil {
			return "", fmt.Errorf("tpl: %v", err)
		}
		var buf strings.Builder
		if err := t.Execute(&buf, data); err != nil {
			return "", fmt.Errorf("tpl: %v", err)
		}
		return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
	}
	funcs["required"] = func(msg string, value interface{}) (interface{}, error) {
		if s, ok := value.(string); value == nil || (ok && s == "") {
			return value, errors.New(msg)
		}
		return value, nil
	}
	funcs["toYaml"] = toYaml
	funcs["fromYaml"] = fromYaml
	funcs["fromJson"] = func(text string) map[string]interface{} {
		out := map[string]interface{}{}
		if err := json.Unmarshal([]byte(text), &out); err != nil {
			out["Error"] = err.Error()
		}
		return out
	}
	// No cluster to ask: Helm's lookup also answers an empty map under `helm template`.
	funcs["lookup"] = func(apiVersion, kind, namespace, name string) map[string]interface{} {
		return map[string]interface{}{}
	}
	return funcs
}

// toYaml marshals like sigs.k8s.io/yaml: JSON first (json tags apply), then that JSON decoded
// and re-encoded by yaml.v2 (which sorts keys), without the trailing newline.
func toYaml(v interface{}) string {
	raw, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	var doc interface{}
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		return ""
	}
	out, err := yaml.Marshal(doc)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(out), "\n")
}

// fromYaml parses a mapping; on failure the map holds the message under "Error", as in Helm.
func fromYaml(text string) map[string]interface{} {
	var doc interface{}
	out := map[string]interface{}{}
	if err := yaml.Unmarshal([]byte(text), &doc); err != nil {
		out["Error"] = err.Error()
		return out
	}
	if m, ok := stringKeys(doc).(map[string]interface{}); ok {
		return m
	}
	return out
}
