package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// childEnv, when set, makes the test binary run as the proxy process of a harness (see
// TestMain) with the childConfig it holds as JSON.
const childEnv = "PDPROXY_BENCH_CHILD"

// childConfig is the proxy a harness asks its child process to run.
type childConfig struct {
	Prefill     []string `json:"prefill"`
	Decode      []string `json:"decode"`
	MaxInflight int      `json:"max_inflight"` // per backend; 0 means the router's default
	NoFile      uint64   `json:"nofile"`       // RLIMIT_NOFILE to raise to; 0 leaves it
	// EngineClient is the router's engine_client; empty means its default.
	EngineClient string `json:"engine_client"`
}

// runChild is the proxy process: app.Main as cmd/proxy runs it, with an admin listener for
// profiles, logging requests as JSON to stderr (which the harness discards unless
// PDPROXY_BENCH_VERBOSE is set). It serves until its stdin closes, so that it also ends when
// the harness dies.
func runChild() int {
	var cc childConfig
	if err := json.Unmarshal([]byte(os.Getenv(childEnv)), &cc); err != nil {
		fmt.Fprintln(os.Stderr, "bench child: config:", err)
		return 2
	}
	if cc.NoFile > 0 {
		if _, err := raiseNoFile(cc.NoFile); err != nil {
			fmt.Fprintln(os.Stderr, "bench child:", err)
		}
	}
	cfg := app.Config{Listen: "127.0.0.1:0", AdminListen: "127.0.0.1:0", LogFormat: "json", ShutdownTimeout: 5 * time.Second}
	cfg.Router.EngineClient = cc.EngineClient
	for _, u := range cc.Prefill {
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{URL: u, Role: routerconfig.RolePrefill, Engine: engine.KindVLLM, MaxInflight: cc.MaxInflight})
	}
	for _, u := range cc.Decode {
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{URL: u, Role: routerconfig.RoleDecode, Engine: engine.KindVLLM, MaxInflight: cc.MaxInflight})
	}
	logger, err := app.NewLogger("json", "info")
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench child:", err)
		return 2
	}
	m, err := app.New(cfg, logger)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench child:", err)
		return 1
	}
	if err := m.Start(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "bench child:", err)
		return 1
	}
	fmt.Printf("ready %s %s\n", m.Addr(), m.AdminAddr())
	io.Copy(io.Discard, os.Stdin)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := m.Shutdown(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "bench child: shutdown:", err)
		return 1
	}
	return 0
}

// proxyProc is a proxy running in a child process.
type proxyProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	url   string // the proxy
	admin string // its admin listener, http://host:port
	http  *http.Client
}

// startProxy runs the test binary again as a proxy process and stops it when the test ends.
func startProxy(t testing.TB, cc childConfig) *proxyProc {
	t.Helper()
	env, err := json.Marshal(cc)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), childEnv+"="+string(env))
	// Settings for the proxy process alone, e.g. GOGC=400: this process keeps its own.
	cmd.Env = append(cmd.Env, strings.Fields(os.Getenv("PDPROXY_BENCH_PROXY_ENV"))...)
	if os.Getenv("PDPROXY_BENCH_VERBOSE") != "" {
		cmd.Stderr = os.Stderr
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the proxy process: %v", err)
	}
	p := &proxyProc{cmd: cmd, stdin: stdin, http: &http.Client{Timeout: 30 * time.Second}}
	line := make(chan string, 1)
	go func() {
		l, _ := bufio.NewReader(stdout).ReadString('\n')
		line <- l
	}()
	var ready string
	select {
	case ready = <-line:
	case <-time.After(time.Minute):
		cmd.Process.Kill()
		<-line
	}
	f := strings.Fields(ready)
	if len(f) != 3 || f[0] != "ready" {
		p.stop()
		t.Fatalf("the proxy process did not start (said %q); PDPROXY_BENCH_VERBOSE=1 shows its log", ready)
	}
	p.url, p.admin = "http://"+f[1], "http://"+f[2]
	t.Cleanup(p.stop)
	return p
}

// stop closes the child's stdin, which shuts it down gracefully, and kills it if that takes
// too long.
func (p *proxyProc) stop() {
	if p.stdin == nil {
		return
	}
	p.stdin.Close()
	p.stdin = nil
	done := make(chan error, 1)
	go func() { done <- p.cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(45 * time.Second):
		p.cmd.Process.Kill()
		<-done
	}
	p.http.CloseIdleConnections()
}

// procSample is the proxy process's own view of itself, from its /metrics.
type procSample struct {
	cpuSeconds float64 // user + system
	rss        float64 // resident bytes
	goroutines float64
	heapInuse  float64
	stackInuse float64
}

var sampleMetrics = map[string]func(*procSample) *float64{
	"process_cpu_seconds_total":     func(s *procSample) *float64 { return &s.cpuSeconds },
	"process_resident_memory_bytes": func(s *procSample) *float64 { return &s.rss },
	"go_goroutines":                 func(s *procSample) *float64 { return &s.goroutines },
	"go_memstats_heap_inuse_bytes":  func(s *procSample) *float64 { return &s.heapInuse },
	"go_memstats_stack_inuse_bytes": func(s *procSample) *float64 { return &s.stackInuse },
}

func (p *proxyProc) sample() (procSample, error) {
	var s procSample
	mfs, err := testutil.Scrape(p.http, p.url+"/metrics").Gather()
	if err != nil {
		return s, fmt.Errorf("scrape the proxy: %w", err)
	}
	seen := 0
	for name, field := range sampleMetrics {
		if v, ok := testutil.Sum(mfs, name, nil); ok {
			*field(&s) = v
			seen++
		}
	}
	if seen != len(sampleMetrics) {
		return s, fmt.Errorf("the proxy's /metrics has %d of the %d process metrics", seen, len(sampleMetrics))
	}
	return s, nil
}

// profile saves one of the proxy's pprof profiles (e.g. "profile?seconds=2", "allocs").
func (p *proxyProc) profile(name, file string) error {
	c := &http.Client{Timeout: 5 * time.Minute}
	defer c.CloseIdleConnections()
	resp, err := c.Get(p.admin + "/debug/pprof/" + name)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("pprof %s: status %d", name, resp.StatusCode)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
