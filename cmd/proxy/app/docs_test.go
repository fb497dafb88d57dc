package app

import (
	"fmt"
	"maps"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"gopkg.in/yaml.v3"
)

// The configuration's keys are written in docs/configuration.md as paths: "health.interval"
// for a section's key, "backends[].url" for a key of each entry of a list, and
// "flow_control.tenants.NAME.weight" for a key of each entry of a map.

// docDefaultsMinimal is the smallest config that reaches every key: one entry in each list
// and map of sections, with only the keys such an entry needs. The keys it sets have no
// default of their own to observe here; theirs are read from docDefaultsEmpty, or are the
// zero value where that has no entry to read them from.
const docDefaultsMinimal = `
backends:
  - {url: "http://127.0.0.1:1", role: decode}
tokenizers:
  m: {file: tokenizer.json}
model_aliases:
  a: [{model: m}]
priority:
  classes: [{name: c}]
flow_control:
  tenant_header: X-Tenant
  tenants: {t: {}}
limits:
  per_key: {max_concurrent: 1}
session_affinity:
  headers: [X-Session-ID]
shared_state:
  redis: {addr: "127.0.0.1:1"}
sims:
  - {role: decode}
`

// docDefaultsEmpty is the least the proxy starts with: one decoder.
const docDefaultsEmpty = `
backends:
  - {url: "http://127.0.0.1:1", role: decode}
`

// docDerived are the keys whose default the code computes from something else (another
// key, the engine, the environment) rather than holds, so that the doc states it in words.
var docDerived = map[string]string{
	"kv_hold_timeout":                  "2/3 of the prefillers' own hold, computed at start",
	"backends[].name":                  "derived from the URL",
	"backends[].engine":                "the engine catalog's default kind",
	"backends[].kv_hold_timeout":       "the engine kind's",
	"backends[].refresh":               "applied by discovery to discover entries only",
	"prefill_unavailable":              "follows decode_only_fallback",
	"ejection.base_backoff":            "one health.interval",
	"tokenizer":                        "follows the policies",
	"tracing.endpoint":                 "the OTEL_* environment",
	"tracing.protocol":                 "the OTEL_* environment",
	"tracing.sampling_ratio":           "the OTEL_* environment",
	"tracing.service_name":             "the OTEL_* environment",
	"limits.per_key.burst":             "follows requests_per_second",
	"priority.default_class":           "the first class",
	"flow_control.tenants.NAME.weight": "flow_control.default_weight",
	"flow_control.queue_timeout":       "queue.timeout",
	"drain_timeout":                    "the prefiller's kv_hold_timeout",
	"auth_open_paths":                  "applied where the keys are read, which tells an absent list from an empty one",
	"kv_events.max_blocks":             "applied by kvcache's index",
	"kv_events.tier_weights":           "kvcache fills each tier left out",
	"model_aliases.NAME[].weight":      "applied where the alias is built; absent is not 0",
	"scrape_interval":                  "follows the count of engines scraped, each round",
}

// docSimFlags are the sims' keys that keep the simulator's own defaults (`proxy sim
// --help`), which the doc refers to.
var docSimFlags = []string{"model", "kv_blocks", "block_size", "prefill_time", "prefill_per_token", "itl",
	"max_running", "max_num_batched_tokens", "kv_hold_timeout", "kv_transfer_time", "seed", "tokenizer",
	"protocol", "bootstrap_timeout", "waiting_timeout", "disconnect_delay", "admin_api_key",
	"scheduling_policy", "lora_modules", "embedding_dim"}

// TestConfigurationDoc holds docs/configuration.md's tables of keys against the config:
// every key the YAML takes is in a table, every key in a table is taken, and the default a
// table states is the one the code applies, as read back from a config loaded the way
// the proxy loads it.
func TestConfigurationDoc(t *testing.T) {
	docKeys := readDocTables(t, "../../../docs/configuration.md")

	minimal := defaultedConfig(t, docDefaultsMinimal)
	empty := defaultedConfig(t, docDefaultsEmpty)
	code := map[string]leaf{}
	walkConfig(t, "", reflect.TypeOf(minimal), reflect.ValueOf(minimal), true, code)
	emptyCode := map[string]leaf{}
	walkConfig(t, "", reflect.TypeOf(empty), reflect.ValueOf(empty), false, emptyCode)
	setMinimal, setEmpty := yamlPaths(t, docDefaultsMinimal), yamlPaths(t, docDefaultsEmpty)

	derived := maps.Clone(docDerived)
	for _, f := range docSimFlags {
		derived["sims[]."+f] = "the simulator's own default"
	}
	for k := range derived {
		if _, ok := code[k]; !ok {
			t.Errorf("docDerived names %s, which the config does not have", k)
		}
	}

	for _, key := range slices.Sorted(maps.Keys(code)) {
		def, ok := docKeys[key]
		if !ok {
			t.Errorf("%s: in the config, not in docs/configuration.md's tables", key)
			continue
		}
		if _, ok := derived[key]; ok {
			continue
		}
		l := code[key]
		v := l.v
		switch {
		case setEmpty[key]:
			v = reflect.Zero(l.typ)
		case setMinimal[key]:
			v = emptyCode[key].v
			if !v.IsValid() {
				v = reflect.Zero(l.typ)
			}
		}
		if !v.IsValid() {
			v = reflect.Zero(l.typ)
		}
		want, err := docValue(def, l.typ)
		if err != nil {
			t.Errorf("%s: the doc's default %q: %v (state the value the code applies, or add the key to docDerived)", key, def, err)
			continue
		}
		if got := deref(v); !reflect.DeepEqual(got.Interface(), want.Interface()) {
			t.Errorf("%s: the doc's default is %q (%v), the code applies %v", key, def, want, got)
		}
	}
	for _, key := range slices.Sorted(maps.Keys(docKeys)) {
		if _, ok := code[key]; !ok {
			t.Errorf("%s: in docs/configuration.md's tables, not in the config", key)
		}
	}
}

// defaultedConfig loads doc as the proxy does, and fills in each section's defaults where
// the proxy fills them in: the app's at New, the router's in router.New (Validate), the
// proxy's in proxy.New, the shared state's in sharedstate.New.
func defaultedConfig(t *testing.T, doc string) Config {
	t.Helper()
	f := t.TempDir() + "/config.yaml"
	if err := os.WriteFile(f, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig([]string{"--config", f}, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	m, err := New(cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	c := m.cfg

	rcfg := c.Router
	rcfg.Engines = EngineCatalog{}
	rcfg.Backends = slices.Clone(rcfg.Backends)
	if err := rcfg.Validate(); err != nil {
		t.Fatalf("router: %v", err)
	}
	c.Router = rcfg
	if c.Proxy, err = c.Proxy.WithDefaults(); err != nil {
		t.Fatalf("proxy: %v", err)
	}
	if c.SharedState, err = c.SharedState.WithDefaults(); err != nil {
		t.Fatalf("shared_state: %v", err)
	}
	return c
}

// leaf is one key of the config: its type, and its value where the config walked has one.
type leaf struct {
	typ reflect.Type
	v   reflect.Value // invalid where the config has no entry of the list or map it is in
}

// walkConfig records every key under v, of type typ, by its path. A list or map of
// sections that is empty has its keys recorded with no value; with full, that is an
// error: the config walked must reach every key.
func walkConfig(t *testing.T, path string, typ reflect.Type, v reflect.Value, full bool, out map[string]leaf) {
	t.Helper()
	base := typ
	for base.Kind() == reflect.Pointer {
		base = base.Elem()
		if v.IsValid() {
			if v.IsNil() {
				v = reflect.Value{}
			} else {
				v = v.Elem()
			}
		}
	}
	entry := func(sub string, ev reflect.Value) {
		if v.IsValid() && !ev.IsValid() && full {
			t.Errorf("%s: empty in the minimal config: give it one entry, so that its keys' defaults are seen", path)
		}
		walkConfig(t, path+sub, base.Elem(), ev, full, out)
	}
	switch {
	case base.Kind() == reflect.Struct && isSection(base):
		prefix := path
		if prefix != "" {
			prefix += "."
		}
		for i := range base.NumField() {
			sf := base.Field(i)
			if !sf.IsExported() {
				continue
			}
			tag, ok := sf.Tag.Lookup("yaml")
			if !ok {
				t.Errorf("%s%s: a field of the config without a yaml tag", prefix, sf.Name)
				continue
			}
			name, opts, _ := strings.Cut(tag, ",")
			if name == "-" {
				continue
			}
			var fv reflect.Value
			if v.IsValid() {
				fv = v.Field(i)
			}
			if opts == "inline" {
				walkConfig(t, path, sf.Type, fv, full, out)
			} else {
				walkConfig(t, prefix+name, sf.Type, fv, full, out)
			}
		}
	case base.Kind() == reflect.Slice && isSectionType(base.Elem()):
		var ev reflect.Value
		if v.IsValid() && v.Len() > 0 {
			ev = v.Index(0)
		}
		entry("[]", ev)
	case base.Kind() == reflect.Map && isSectionType(base.Elem()):
		var ev reflect.Value
		if v.IsValid() && v.Len() > 0 {
			ev = v.MapIndex(v.MapKeys()[0])
		}
		entry(".NAME", ev)
	default:
		out[path] = leaf{typ: base, v: v}
	}
}

// isSection reports whether a struct holds keys of its own (rather than being one value).
func isSection(t reflect.Type) bool {
	for i := range t.NumField() {
		if _, ok := t.Field(i).Tag.Lookup("yaml"); ok {
			return true
		}
	}
	return false
}

// isSectionType reports whether values of t hold keys: sections, and lists of sections.
func isSectionType(t reflect.Type) bool {
	for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice {
		t = t.Elem()
	}
	return t.Kind() == reflect.Struct && isSection(t)
}

// yamlPaths are the keys a YAML document sets, as paths.
func yamlPaths(t *testing.T, doc string) map[string]bool {
	t.Helper()
	var n yaml.Node
	if err := yaml.Unmarshal([]byte(doc), &n); err != nil {
		t.Fatal(err)
	}
	paths := map[string]bool{}
	var walk func(prefix string, n *yaml.Node, mapOfSections bool)
	walk = func(prefix string, n *yaml.Node, _ bool) {
		switch n.Kind {
		case yaml.DocumentNode:
			walk(prefix, n.Content[0], false)
		case yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				p := prefix + n.Content[i].Value
				paths[p] = true
				walk(p+".", n.Content[i+1], false)
			}
		case yaml.SequenceNode:
			for _, c := range n.Content {
				walk(strings.TrimSuffix(prefix, ".")+"[].", c, false)
			}
		}
	}
	walk("", &n, false)
	// The entries of maps are named NAME in the doc's paths.
	out := map[string]bool{}
	for p := range paths {
		for _, m := range []string{"tokenizers.m", "model_aliases.a", "flow_control.tenants.t"} {
			if p == m || strings.HasPrefix(p, m+".") || strings.HasPrefix(p, m+"[]") {
				p = strings.Replace(p, m, m[:strings.LastIndex(m, ".")]+".NAME", 1)
			}
		}
		out[p] = true
	}
	return out
}

// readDocTables reads every "| key | default | what it does |" table of the doc: each row's
// keys (the code spans of its first cell) and its default. A row of several keys states
// one default for all, or one each, comma-separated.
func readDocTables(t *testing.T, path string) map[string]string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]string{}
	in := false
	for i, line := range strings.Split(string(data), "\n") {
		switch {
		case strings.HasPrefix(line, "| key | default |"):
			in = true
			continue
		case !strings.HasPrefix(line, "|"):
			in = false
			continue
		case !in || strings.HasPrefix(line, "|---"):
			continue
		}
		cells := splitRow(line)
		if len(cells) < 3 {
			t.Errorf("docs/configuration.md:%d: a row of %d cells", i+1, len(cells))
			continue
		}
		names := codeSpans.FindAllStringSubmatch(cells[0], -1)
		if len(names) == 0 {
			t.Errorf("docs/configuration.md:%d: no key in %q", i+1, cells[0])
		}
		defs := []string{cells[1]}
		if parts := strings.Split(cells[1], ", "); len(names) > 1 && len(parts) == len(names) &&
			!slices.ContainsFunc(parts, func(p string) bool { return !docLiteral.MatchString(p) }) {
			defs = parts
		}
		for j, n := range names {
			if _, dup := keys[n[1]]; dup {
				t.Errorf("docs/configuration.md:%d: %s is in the tables twice", i+1, n[1])
			}
			keys[n[1]] = defs[min(j, len(defs)-1)]
		}
	}
	return keys
}

var codeSpans = regexp.MustCompile("`([^`]+)`")

// splitRow splits a table row into its cells; "\|" is a pipe within a cell.
func splitRow(line string) []string {
	line = strings.Trim(line, "|")
	var cells []string
	var b strings.Builder
	for i := 0; i < len(line); i++ {
		switch {
		case line[i] == '\\' && i+1 < len(line) && line[i+1] == '|':
			b.WriteByte('|')
			i++
		case line[i] == '|':
			cells = append(cells, strings.TrimSpace(b.String()))
			b.Reset()
		default:
			b.WriteByte(line[i])
		}
	}
	return append(cells, strings.TrimSpace(b.String()))
}

// docLiteral is a default stated as a value: a code span, a number (with a binary size
// unit), a duration, or none, off, required, true or false, alone or followed by ": ",
// " (", "; " or ", " and words about it.
var docLiteral = regexp.MustCompile("^(`[^`]*`|[^ `:;,()]+|[0-9.]+ [KMG]iB)(?:$|: | \\(|; |, )")

var sizeUnit = regexp.MustCompile(`^([0-9]+) ?(Ki|Mi|Gi)B?$`)

// docValue is the value a doc's default cell states, of type typ (pointers stated as what
// they point to).
func docValue(cell string, typ reflect.Type) (reflect.Value, error) {
	for typ.Kind() == reflect.Pointer {
		typ = typ.Elem()
	}
	m := docLiteral.FindStringSubmatch(cell)
	if m == nil {
		return reflect.Value{}, fmt.Errorf("not a value")
	}
	s := m[1]
	switch s {
	case "none", "off", "required":
		return reflect.Zero(typ), nil
	}
	if u := sizeUnit.FindStringSubmatch(s); u != nil {
		n, _ := strconv.Atoi(u[1])
		shift := map[string]int{"Ki": 10, "Mi": 20, "Gi": 30}[u[2]]
		s = strconv.Itoa(n << shift)
	}
	s = strings.Trim(s, "`")
	switch typ {
	case reflect.TypeFor[string]():
		return reflect.ValueOf(s), nil
	case reflect.TypeFor[time.Duration]():
		d, err := time.ParseDuration(s)
		return reflect.ValueOf(d), err
	}
	p := reflect.New(typ)
	if err := yaml.Unmarshal([]byte(s), p.Interface()); err != nil {
		return reflect.Value{}, err
	}
	return p.Elem(), nil
}

// deref is v without its pointers, a nil pointer standing for the zero value.
func deref(v reflect.Value) reflect.Value {
	for v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return reflect.Zero(v.Type().Elem())
		}
		v = v.Elem()
	}
	return v
}
