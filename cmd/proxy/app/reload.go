package app

import (
	"context"
	"errors"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"go.uber.org/zap"
	"gopkg.in/yaml.v3"

	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Reload reads the config file at path again and applies its router part: the backends,
// the selection policies, health checks, ejection and the queue. The command line's flags
// apply on top as they did at startup, and the in-process simulated engines stay. Requests
// in flight are not dropped: a removed backend is no longer picked, and the leases on it
// still end normally. The rest of the file (listen, sims, kv_hold_timeout, the proxy's
// timeouts and modes ...) takes effect only on a restart; a change there is logged as
// ignored. A file that does not parse or validate, a prefiller that would free its KV
// sooner than the running kv_hold_timeout, or a changed shared_state is rejected with an
// error naming the field (and its line where it has one), and the running config stays.
func (m *Main) Reload(path string) error {
	m.reloadMu.Lock()
	defer m.reloadMu.Unlock()
	if m.Router == nil {
		return errors.New("reload: the proxy is not started")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("reload: %w", err)
	}
	cfg, err := ParseConfig(data)
	if err != nil {
		return fmt.Errorf("reload %s: %w", path, err)
	}
	src := m.cfg.Source
	src.File = path
	if cfg, err = src.apply(cfg); err != nil {
		return fmt.Errorf("reload %s: %w", path, err)
	}
	cfg.setDefaults()
	if !reflect.DeepEqual(cfg.SharedState, m.cfg.SharedState) {
		// Not logged as ignored with the rest: a replica that went on with the old Redis
		// while its file names another would share its limits with the wrong replicas.
		return fmt.Errorf("reload %s: shared_state: changed, and only a restart applies it: this replica's requests in flight hold their slots in the running one", path)
	}

	rcfg := cfg.Router
	rcfg.Engines = EngineCatalog{}
	rcfg.Resolver = m.cfg.Router.Resolver                                                                                    // not in the file: what the proxy was started with
	rcfg.Queue.TTFTBound, rcfg.Queue.ReservedSlots = m.cfg.Proxy.FlowControl.SaturationTTFT, m.cfg.Proxy.FlowControl.Slots() // flow control is the proxy's, kept from the start
	rcfg.SharedPlacements = m.cfg.SharedState.Enabled()                                                                      // shared_state, kept from the start
	rcfg.Backends = slices.Clone(rcfg.Backends)
	for i, p := range m.sims {
		rcfg.Backends = append(rcfg.Backends, simBackend(i, p))
	}
	// Validate here, on a copy, rather than leave it to the router: its errors then get
	// their lines in the file, and the hold rule below sees the defaults filled in.
	checked := rcfg
	checked.Backends = slices.Clone(rcfg.Backends)
	if err := checked.Validate(); err != nil {
		return fmt.Errorf("reload %s: %w", path, withLines(data, err))
	}
	if err := m.checkHolds(checked.Backends); err != nil {
		return fmt.Errorf("reload %s: %w", path, withLines(data, err))
	}
	if err := checkConditional(m.cfg.Proxy, checked); err != nil {
		return fmt.Errorf("reload %s: %w", path, err)
	}
	statuses := make([]router.BackendStatus, len(checked.Backends))
	for i, b := range checked.Backends {
		statuses[i] = router.BackendStatus{Name: b.Name, URL: b.URL, Role: b.Role, Engine: b.Engine}
	}
	if err := m.Server.CheckBackends(statuses); err != nil {
		return fmt.Errorf("reload %s: %w", path, err)
	}
	if err := m.Router.Reload(rcfg); err != nil {
		return fmt.Errorf("reload %s: %w", path, err)
	}
	m.discoverBootstrapPorts(context.Background())
	if keys := restartOnlyChanges(m.cfg, cfg); len(keys) > 0 {
		m.logger.Warn("config reload ignored settings that need a restart", zap.String("file", path), zap.Strings("keys", keys))
	}
	m.logger.Info("config reloaded", zap.String("file", path),
		zap.Int("prefill_backends", countRole(rcfg.Backends, routerconfig.RolePrefill)),
		zap.Int("decode_backends", countRole(rcfg.Backends, routerconfig.RoleDecode)))
	return nil
}

// checkHolds is the rule Start checks, for the running kv_hold_timeout (a reload does not
// change it): the proxy forwards a prefiller's KV params for that long, so no prefiller
// may free its blocks sooner. bs have their defaults filled in.
func (m *Main) checkHolds(bs []routerconfig.BackendConfig) error {
	var errs []error
	for i, b := range bs {
		if b.Role == routerconfig.RolePrefill && maxHoldTimeout(b.KVHoldTimeout) < m.holdTimeout {
			errs = append(errs, fmt.Errorf("backends[%d].kv_hold_timeout: %s leaves less than the running kv_hold_timeout %s (which only a restart changes) plus its margin (it must be at least 3/2 of it): a decoder could read blocks the prefiller already freed",
				i, b.KVHoldTimeout, m.holdTimeout))
		}
	}
	return errors.Join(errs...)
}

// restartOnlyChanges names, by their YAML keys, the settings that differ between the
// running config and a reloaded one and that only a restart applies: everything but the
// router's part. Both have their defaults filled in.
func restartOnlyChanges(running, next Config) []string {
	running.Router, next.Router = routerconfig.Config{}, routerconfig.Config{}
	return changedKeys(reflect.ValueOf(running), reflect.ValueOf(next))
}

// changedKeys compares two structs of one type field by field, descending into inlined
// ones; fields without a YAML key are skipped.
func changedKeys(a, b reflect.Value) []string {
	var out []string
	t := a.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		key, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if !f.IsExported() || key == "-" {
			continue
		}
		if opts == "inline" {
			out = append(out, changedKeys(a.Field(i), b.Field(i))...)
			continue
		}
		if !reflect.DeepEqual(a.Field(i).Interface(), b.Field(i).Interface()) {
			out = append(out, key)
		}
	}
	return out
}

// withLines adds, to every line of err of the form "field: message" (the router's
// validation errors, e.g. "backends[1].url: ..."), the line in data where that field is, or
// where its closest parent is when the field itself is missing.
func withLines(data []byte, err error) error {
	var doc yaml.Node
	if yaml.Unmarshal(data, &doc) != nil || len(doc.Content) == 0 {
		return err
	}
	lines := strings.Split(err.Error(), "\n")
	for i, l := range lines {
		field, msg, ok := strings.Cut(l, ": ")
		if !ok {
			continue
		}
		if n := lineOf(doc.Content[0], field); n > 0 {
			lines[i] = fmt.Sprintf("%s (line %d): %s", field, n, msg)
		}
	}
	return errors.New(strings.Join(lines, "\n"))
}

// lineOf finds a field path such as "backends[1].url" or "health.path" in a YAML mapping
// and returns its line, or its closest parent's; 0 when not even its first key is there.
func lineOf(n *yaml.Node, path string) int {
	line := 0
	for _, part := range strings.Split(path, ".") {
		key, idx := part, -1
		if j := strings.IndexByte(part, '['); j > 0 && strings.HasSuffix(part, "]") {
			k, err := strconv.Atoi(part[j+1 : len(part)-1])
			if err != nil {
				return line
			}
			key, idx = part[:j], k
		}
		if n.Kind != yaml.MappingNode {
			return line
		}
		var next *yaml.Node
		for i := 0; i+1 < len(n.Content); i += 2 {
			if n.Content[i].Value == key {
				line, next = n.Content[i].Line, n.Content[i+1]
				break
			}
		}
		if next == nil {
			return line
		}
		n = next
		if idx >= 0 {
			if n.Kind != yaml.SequenceNode || idx >= len(n.Content) {
				return line
			}
			n = n.Content[idx]
			line = n.Line
		}
	}
	return line
}
