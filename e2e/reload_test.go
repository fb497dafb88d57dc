package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/sim"
)

// debugBackends reads the proxy's GET /debug/backends.
func debugBackends(t *testing.T, base string) []router.BackendStatus {
	t.Helper()
	resp, err := http.Get(base + "/debug/backends")
	if err != nil {
		t.Fatalf("GET /debug/backends: %v", err)
	}
	defer resp.Body.Close()
	var bs []router.BackendStatus
	if err := json.NewDecoder(resp.Body).Decode(&bs); err != nil {
		t.Fatalf("decode /debug/backends: %v", err)
	}
	return bs
}

func backendNames(bs []router.BackendStatus) []string {
	var out []string
	for _, b := range bs {
		out = append(out, b.Name)
	}
	slices.Sort(out)
	return out
}

func writeFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

// logged returns the process's JSON log lines with message msg.
func (p *process) logged(msg string) []map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []map[string]any
	for _, l := range p.lines {
		if l["msg"] == msg {
			out = append(out, l)
		}
	}
	return out
}

// startSimEngine runs one simulated engine on a port of its own, outside the proxy, so a
// reload can add and remove it.
func startSimEngine(t *testing.T, mutate func(*sim.Config)) *httptest.Server {
	t.Helper()
	cfg := sim.DefaultConfig()
	mutate(&cfg)
	eng, err := sim.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- eng.Run(ctx) }()
	srv := httptest.NewServer(eng.Handler())
	t.Cleanup(func() {
		srv.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("sim engine: %v", err)
		}
	})
	return srv
}

func TestReloadRejectsABadFileNamingTheFieldAndLineAndKeepsTheBackends(t *testing.T) {
	s := startStack(t, fastSims)
	before := backendNames(s.m.Router.Backends())
	for _, tc := range []struct {
		name, file string
		want       []string
	}{
		{"an unknown key", "backends:\n  - url: http://127.0.0.1:1\n    role: decode\nkv_hold_timout: 10s\n",
			[]string{"kv_hold_timout", "line 4"}},
		{"a value of the wrong type", "queue:\n  timeout: soon\n",
			[]string{"line 2", "soon"}},
		{"a url the router refuses", "backends:\n  - name: d\n    url: ftp://127.0.0.1:1\n    role: decode\n",
			[]string{"backends[0].url (line 3)", "scheme"}},
		{"a missing role", "health:\n  interval: 1s\nbackends:\n  - url: http://127.0.0.1:1\n",
			[]string{"backends[0].role (line 4)"}},
		{"a prefiller that frees its KV before the proxy's hold ends", "backends:\n  - url: http://127.0.0.1:1\n    role: prefill\n    engine: sim\n    kv_hold_timeout: 10s\n",
			[]string{"backends[0].kv_hold_timeout (line 5)", "20s"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "proxy.yaml")
			writeFile(t, path, tc.file)
			err := s.m.Reload(path)
			if err == nil {
				t.Fatalf("reload accepted:\n%s", tc.file)
			}
			t.Logf("rejected: %v", err)
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			if got := backendNames(s.m.Router.Backends()); !slices.Equal(got, before) {
				t.Errorf("backends after a rejected reload = %v, want %v", got, before)
			}
		})
	}
	completionOK(t, s.url)
	s.assertQuiet(time.Second)
}

func TestReloadRemovingADecoderLetsItsStreamFinish(t *testing.T) {
	s := startStack(t, fastSims)
	extra := startSimEngine(t, func(c *sim.Config) {
		c.Role = "decode"
		c.ITL = 10 * time.Millisecond
	})
	path := filepath.Join(t.TempDir(), "proxy.yaml")
	// The weight wins least_inflight's tie on an idle pool: the stream lands on extra.
	writeFile(t, path, "backends:\n  - name: extra\n    url: "+extra.URL+"\n    role: decode\n    engine: sim\n    weight: 100\n")
	if err := s.m.Reload(path); err != nil {
		t.Fatal(err)
	}
	if got := backendNames(debugBackends(t, s.url)); !slices.Contains(got, "extra") {
		t.Fatalf("backends after adding extra: %v", got)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp := post(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"a long one","max_tokens":40,"ignore_eos":true,"stream":true}`)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if first, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(first, "data: {") {
		t.Fatalf("first line %q, %v", first, err)
	}
	if st := kv(t, extra.URL); st.RunningRequests != 1 {
		t.Fatalf("extra runs %d requests, want the stream", st.RunningRequests)
	}

	writeFile(t, path, "# the in-process engines stay\nbackends: []\n")
	if err := s.m.Reload(path); err != nil {
		t.Fatal(err)
	}
	if got := backendNames(debugBackends(t, s.url)); slices.Contains(got, "extra") {
		t.Fatalf("extra still listed after its removal: %v", got)
	}
	served := kv(t, extra.URL).RequestsTotal
	completionOK(t, s.url)
	if got := kv(t, extra.URL).RequestsTotal; got != served {
		t.Errorf("a removed decoder got %d new requests", got-served)
	}

	events := sseEvents(t, br)
	if len(events) == 0 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("the stream on the removed decoder did not finish: last events %q", events[max(0, len(events)-3):])
	}
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		st := kv(t, extra.URL)
		return st.BlocksFree == st.BlocksTotal && st.RunningRequests == 0, "extra: " + jsonString(st)
	})
	s.assertQuiet(time.Second)
}

func TestSIGHUPReloadsTheConfigFile(t *testing.T) {
	_, a := startProcess(t, "sim engine listening", "sim", "--role", "decode", "--listen", "127.0.0.1:0", "--itl", "1ms")
	_, b := startProcess(t, "sim engine listening", "sim", "--role", "decode", "--listen", "127.0.0.1:0", "--itl", "1ms")
	decoder := func(name, addr string) string {
		return fmt.Sprintf("  - name: %s\n    url: http://%s\n    role: decode\n    engine: sim\n", name, addr)
	}
	head := "listen: 127.0.0.1:0\nlog_format: json\nshutdown_timeout: 2s\nbackends:\n"
	path := filepath.Join(t.TempDir(), "proxy.yaml")
	writeFile(t, path, head+decoder("decode-a", a))
	px, addr := startProcess(t, "proxy listening", "--config", path)
	base := "http://" + addr
	completionOK(t, base)
	hup := func() {
		t.Helper()
		if err := px.cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("a second decoder is added", func(t *testing.T) {
		writeFile(t, path, strings.Replace(head, "2s", "3s", 1)+decoder("decode-a", a)+decoder("decode-b", b))
		hup()
		testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
			bs := debugBackends(t, base)
			for _, st := range bs {
				if st.Name == "decode-b" && st.Healthy {
					return true, ""
				}
			}
			return false, fmt.Sprintf("backends %+v\n%s", bs, px.log())
		})
		// shutdown_timeout takes a restart: the proxy says it did not apply it.
		testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
			for _, l := range px.logged("config reload ignored settings that need a restart") {
				if fmt.Sprint(l["keys"]) == "[shutdown_timeout]" {
					return true, ""
				}
			}
			return false, "no log line naming shutdown_timeout as ignored:\n" + px.log()
		})
		completionOK(t, base)
	})

	t.Run("a file with an unknown key is rejected and the backends stay", func(t *testing.T) {
		writeFile(t, path, head+decoder("decode-a", a)+"kv_hold_timout: 10s\n")
		hup()
		var line map[string]any
		testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
			ls := px.logged("config reload rejected, the running config stays")
			if len(ls) == 0 {
				return false, "no rejection logged:\n" + px.log()
			}
			line = ls[0]
			return true, ""
		})
		if e := fmt.Sprint(line["error"]); !strings.Contains(e, "kv_hold_timout") || !strings.Contains(e, "line 9") {
			t.Errorf("rejection does not name the key and its line: %q", e)
		}
		if got := backendNames(debugBackends(t, base)); !slices.Equal(got, []string{"decode-a", "decode-b"}) {
			t.Errorf("backends after the rejected reload: %v", got)
		}
		completionOK(t, base)
	})

	if code := px.stop(syscall.SIGTERM); code != 0 {
		t.Fatalf("exit code %d:\n%s", code, px.log())
	}
}

func TestSIGHUPWithoutAConfigFileReloadsNothing(t *testing.T) {
	px, addr := startProcess(t, "proxy listening", "--listen", "127.0.0.1:0", "--log-format", "json")
	if err := px.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
		return len(px.logged("sighup: nothing to reload, the proxy was started without --config")) == 1, "not logged:\n" + px.log()
	})
	completionOK(t, "http://"+addr)
	if code := px.stop(syscall.SIGTERM); code != 0 {
		t.Fatalf("exit code %d:\n%s", code, px.log())
	}
}
