// Command render is a small, offline stand-in for `helm template`: it renders a chart with Go's
// text/template, the sprig function set and Helm's own functions (include, tpl, toYaml, required,
// lookup, ...), the way Helm 3 does, and prints the manifests in `helm template`'s format.
//
// Usage:
//
//	render [-f values.yaml]... [--set a.b=v]... [--name R] [--namespace N]
//	       [--api-versions G/V]... [--notes] CHART_DIR
//
// It exists so the chart's tests run where the helm binary cannot be installed; see README.md
// for what it covers and how it differs from Helm.
package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"text/template"

	"gopkg.in/yaml.v2"
)

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

type options struct {
	chartDir    string
	valueFiles  multiFlag
	sets        multiFlag
	apiVersions multiFlag
	name        string
	namespace   string
	notes       bool
}

func main() {
	opts, err := parseArgs(os.Args[1:])
	if err == nil {
		err = run(opts)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "Error: %v\n", err)
		os.Exit(1)
	}
}

// parseArgs accepts flags before and after the chart directory, like helm does.
func parseArgs(args []string) (options, error) {
	opts := options{name: "release-name", namespace: "default"}
	lists := map[string]*multiFlag{
		"-f": &opts.valueFiles, "--values": &opts.valueFiles,
		"--set": &opts.sets, "-a": &opts.apiVersions, "--api-versions": &opts.apiVersions,
	}
	strs := map[string]*string{"--name": &opts.name, "--namespace": &opts.namespace, "-n": &opts.namespace}
	for i := 0; i < len(args); i++ {
		arg := args[i]
		key, value, inline := strings.Cut(arg, "=")
		list, isList := lists[key]
		str, isStr := strs[key]
		switch {
		case arg == "--notes":
			opts.notes = true
		case isList || isStr:
			if !inline {
				if i+1 >= len(args) {
					return opts, fmt.Errorf("flag %s needs a value", key)
				}
				i++
				value = args[i]
			}
			if isList {
				_ = list.Set(value)
			} else {
				*str = value
			}
		case strings.HasPrefix(arg, "-"):
			return opts, fmt.Errorf("unknown flag %s", arg)
		case opts.chartDir == "":
			opts.chartDir = arg
		default:
			return opts, fmt.Errorf("unexpected argument %q", arg)
		}
	}
	if opts.chartDir == "" {
		return opts, fmt.Errorf("usage: render [-f values.yaml]... [--set k=v]... CHART_DIR")
	}
	return opts, nil
}

func run(opts options) error {
	chart, err := loadChartMeta(opts.chartDir)
	if err != nil {
		return err
	}
	values, err := loadValues(opts.chartDir, opts.valueFiles, opts.sets)
	if err != nil {
		return err
	}
	if err := validateSchema(opts.chartDir, values); err != nil {
		return err
	}
	name, _ := chart["Name"].(string)
	top := map[string]interface{}{
		"Values": values,
		"Chart":  chart,
		"Release": map[string]interface{}{
			"Name": opts.name, "Namespace": opts.namespace, "Service": "Helm",
			"IsInstall": true, "IsUpgrade": false, "Revision": 1,
		},
		"Capabilities": capabilities(opts.apiVersions),
	}
	files, err := templateFiles(opts.chartDir, name)
	if err != nil {
		return err
	}
	tmpl, err := parseTemplates(files)
	if err != nil {
		return err
	}
	return renderAll(tmpl, files, top, opts.notes)
}

// loadChartMeta reads Chart.yaml into the capitalised fields templates see as .Chart.
func loadChartMeta(dir string) (map[string]interface{}, error) {
	raw, err := os.ReadFile(filepath.Join(dir, "Chart.yaml"))
	if err != nil {
		return nil, fmt.Errorf("not a chart: %v", err)
	}
	var meta map[string]interface{}
	if err := yaml.Unmarshal(raw, &meta); err != nil {
		return nil, fmt.Errorf("Chart.yaml: %v", err)
	}
	chart := map[string]interface{}{}
	for key, value := range meta {
		chart[strings.ToUpper(key[:1])+key[1:]] = value
	}
	if _, ok := chart["Name"].(string); !ok {
		return nil, fmt.Errorf("Chart.yaml: name is missing")
	}
	return chart, nil
}

// templateFile is one file under templates/, named as Helm names it: "<chart>/templates/<path>".
type templateFile struct {
	name string
	text string
}

func templateFiles(dir, chartName string) ([]templateFile, error) {
	var files []templateFile
	root := filepath.Join(dir, "templates")
	err := filepath.Walk(root, func(path string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return err
		}
		raw, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		files = append(files, templateFile{chartName + "/" + filepath.ToSlash(rel), string(raw)})
		return nil
	})
	sort.Slice(files, func(i, j int) bool { return files[i].name < files[j].name })
	return files, err
}

// parseTemplates parses every file into one set, so each sees the others' `define`s.
func parseTemplates(files []templateFile) (*template.Template, error) {
	tmpl := template.New("chart").Option("missingkey=zero")
	tmpl.Funcs(funcMap(tmpl))
	for _, f := range files {
		if _, err := tmpl.New(f.name).Parse(f.text); err != nil {
			return nil, err
		}
	}
	return tmpl, nil
}

var separator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// renderAll prints every manifest (files not starting with "_", NOTES.txt aside) as
// `helm template` does, or with notes set, only the rendered NOTES.txt.
func renderAll(tmpl *template.Template, files []templateFile, top map[string]interface{}, notes bool) error {
	var out bytes.Buffer
	for _, f := range files {
		base := filepath.Base(f.name)
		isNotes := base == "NOTES.txt"
		if strings.HasPrefix(base, "_") || isNotes != notes {
			continue
		}
		text, err := execute(tmpl, f.name, top)
		if err != nil {
			return err
		}
		if notes {
			out.WriteString(text)
			continue
		}
		for _, doc := range separator.Split(text, -1) {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", f.name, strings.Trim(doc, "\n"))
		}
	}
	_, err := os.Stdout.Write(out.Bytes())
	return err
}

func execute(tmpl *template.Template, name string, top map[string]interface{}) (string, error) {
	data := withTemplate(top, name)
	var buf strings.Builder
	if err := tmpl.ExecuteTemplate(&buf, name, data); err != nil {
		return "", err
	}
	// Helm prints a missing value as nothing, not as Go's "<no value>".
	return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
}

// withTemplate adds .Template (Name, BasePath) for one file, as Helm does.
func withTemplate(top map[string]interface{}, name string) map[string]interface{} {
	data := map[string]interface{}{}
	for k, v := range top {
		data[k] = v
	}
	chartName := strings.SplitN(name, "/", 2)[0]
	data["Template"] = map[string]interface{}{"Name": name, "BasePath": chartName + "/templates"}
	return data
}

// apiVersions answers .Capabilities.APIVersions.Has the way Helm does for a cluster that
// serves the built-in groups plus any given with --api-versions.
type apiVersions []string

func (a apiVersions) Has(version string) bool {
	for _, v := range a {
		if v == version {
			return true
		}
	}
	return false
}

func capabilities(extra []string) map[string]interface{} {
	builtin := []string{
		"v1", "apps/v1", "batch/v1", "policy/v1", "autoscaling/v2",
		"networking.k8s.io/v1", "rbac.authorization.k8s.io/v1",
	}
	return map[string]interface{}{
		"APIVersions": apiVersions(append(builtin, extra...)),
		"KubeVersion": map[string]interface{}{
			"Version": "v1.31.0", "GitVersion": "v1.31.0", "Major": "1", "Minor": "31",
		},
		"HelmVersion": map[string]interface{}{"Version": "v3.16.0"},
	}
}
