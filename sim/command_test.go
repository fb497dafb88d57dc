package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// syncBuffer is a bytes.Buffer safe for a writer and a reader in two goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func TestRunCommandHelpListsEveryFlagAndReturnsErrHelp(t *testing.T) {
	var stderr syncBuffer
	err := RunCommand(context.Background(), []string{"--help"}, io.Discard, &stderr)
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("RunCommand --help = %v, want flag.ErrHelp", err)
	}
	usage := stderr.String()
	for _, name := range []string{
		"role", "listen", "model", "kv-blocks", "block-size", "prefill-time", "itl", "max-running",
		"kv-hold-timeout", "kv-transfer-time", "prefill-per-token", "seed",
		"fail-status", "stall", "close-after", "slow-write", "engine-id",
		"kv-heartbeat-interval", "max-model-len", "nixl-handshake-delay",
		"protocol", "bootstrap-port", "bootstrap-timeout", "waiting-timeout", "disconnect-delay",
		"admin-api-key", "transfer-fail", "die-after", "shutdown-timeout",
		"prefix-cache", "kv-events-endpoint", "kv-events-replay-endpoint", "kv-events-topic", "kv-events-format", "data-parallel-rank",
		"data-parallel-size", "kv-load-failure-policy", "lora-modules", "embedding-dim", "scheduling-policy",
		"cpu-offload-blocks", "cpu-reload-per-block",
	} {
		if !strings.Contains(usage, "  -"+name+" ") && !strings.Contains(usage, "  -"+name+"\n") {
			t.Errorf("usage does not document -%s:\n%s", name, usage)
		}
	}
}

func TestRunCommandRejectsBadFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
	}{
		{"unknown flag", []string{"--nope"}},
		{"unknown role", []string{"--role", "router"}},
		{"stray argument", []string{"extra"}},
		{"unknown protocol", []string{"--protocol", "trtllm"}},
		{"sglang without a disaggregation role", []string{"--protocol", "sglang"}},
		{"a bootstrap port out of range", []string{"--protocol", "sglang", "--role", "prefill", "--bootstrap-port", "70000"}},
		{"an unknown kv events format", []string{"--kv-events-endpoint", "tcp://*:0", "--kv-events-format", "json"}},
		{"a kv events endpoint that is not one", []string{"--kv-events-endpoint", "localhost:5557"}},
		{"a prefix-cache value that is not a boolean", []string{"--prefix-cache=maybe"}},
		{"a model list naming no model", []string{"--model", " , "}},
		{"a lora module without a path", []string{"--lora-modules", "sql-lora"}},
		{"an unknown scheduling policy", []string{"--scheduling-policy", "lifo"}},
		{"a negative embedding dim", []string{"--embedding-dim", "-1"}},
		{"a CPU tier without the prefix cache", []string{"--cpu-offload-blocks", "64", "--prefix-cache=false"}},
		{"a negative CPU reload time", []string{"--cpu-offload-blocks", "64", "--cpu-reload-per-block", "-1ms"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := RunCommand(context.Background(), tt.args, io.Discard, io.Discard)
			if err == nil || errors.Is(err, flag.ErrHelp) {
				t.Errorf("RunCommand %q = %v, want an error", tt.args, err)
			}
		})
	}
}

func TestRunCommandServesOnPortZeroAndStopsWhenCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- RunCommand(ctx, []string{"--listen", "127.0.0.1:0", "--role", "prefill", "--itl", "1ms", "--prefill-time", "1ms"}, io.Discard, &stderr)
	}()
	addr := ""
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		for _, line := range strings.Split(stderr.String(), "\n") {
			var entry struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if json.Unmarshal([]byte(line), &entry) == nil && entry.Msg == "sim engine listening" {
				addr = entry.Addr
			}
		}
		return addr != "", "no listening log line; stderr:\n" + stderr.String()
	})
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	resp, err := client.Post("http://"+addr+"/v1/completions", "application/json",
		strings.NewReader(`{"prompt":"hi","max_tokens":1,`+prefillKV+`}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"remote_port":`+addr[strings.LastIndex(addr, ":")+1:]) {
		t.Errorf("prefill via RunCommand: %d %s", resp.StatusCode, body)
	}
	cancel()
	if err := testutil.Recv(t, testutil.Timeout, done, "RunCommand's return"); err != nil {
		t.Errorf("RunCommand after cancel = %v, want nil", err)
	}
}

func TestRunCommandSGLangPrefillerReportsItsBootstrapPort(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- RunCommand(ctx, []string{"--listen", "127.0.0.1:0", "--protocol", "sglang", "--role", "prefill", "--bootstrap-port", "0"}, io.Discard, &stderr)
	}()
	addr, boot := "", ""
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		for _, line := range strings.Split(stderr.String(), "\n") {
			var entry struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if json.Unmarshal([]byte(line), &entry) != nil {
				continue
			}
			switch entry.Msg {
			case "sim engine listening":
				addr = entry.Addr
			case "bootstrap server listening":
				boot = entry.Addr
			}
		}
		return addr != "" && boot != "", "no listening log lines; stderr:\n" + stderr.String()
	})
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	resp, err := client.Get("http://" + addr + "/server_info")
	if err != nil {
		t.Fatal(err)
	}
	var info struct {
		Mode string `json:"disaggregation_mode"`
		Port int    `json:"disaggregation_bootstrap_port"`
	}
	err = json.NewDecoder(resp.Body).Decode(&info)
	resp.Body.Close()
	if err != nil || info.Mode != "prefill" || boot != fmt.Sprintf("127.0.0.1:%d", info.Port) {
		t.Errorf("/server_info = %+v (%v), want mode prefill and the bootstrap server's port (%s)", info, err, boot)
	}
	cancel()
	if err := testutil.Recv(t, testutil.Timeout, done, "RunCommand's return"); err != nil {
		t.Errorf("RunCommand after cancel = %v, want nil", err)
	}
}

func TestRunCommandPublishesKVEventsAndHonoursPrefixCacheFalse(t *testing.T) {
	tests := []struct {
		name       string
		args       []string
		wantCached int
	}{
		{"prefix caching on, events bound on a wildcard", []string{"--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "tcp://*:0", "--kv-events-format", "map"}, 32},
		{"--prefix-cache=false", []string{"--prefix-cache=false"}, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var stderr syncBuffer
			done := make(chan error, 1)
			go func() {
				done <- RunCommand(ctx, append([]string{"--listen", "127.0.0.1:0", "--itl", "1ms", "--prefill-time", "1ms"}, tt.args...), io.Discard, &stderr)
			}()
			var entry struct {
				Msg    string `json:"msg"`
				Addr   string `json:"addr"`
				Events string `json:"kv_events_endpoint"`
			}
			testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
				for _, line := range strings.Split(stderr.String(), "\n") {
					if json.Unmarshal([]byte(line), &entry) == nil && entry.Msg == "sim engine listening" {
						return true, ""
					}
				}
				return false, "no listening log line; stderr:\n" + stderr.String()
			})
			if strings.Contains(strings.Join(tt.args, " "), "kv-events") && !strings.HasPrefix(entry.Events, "tcp://") {
				t.Errorf("logged kv_events_endpoint %q, want the bound tcp address", entry.Events)
			}
			client := &http.Client{Transport: &http.Transport{}}
			defer client.CloseIdleConnections()
			var cached int
			for range 2 {
				resp, err := client.Post("http://"+entry.Addr+"/v1/completions", "application/json",
					strings.NewReader(`{"prompt":"`+strings.Repeat("abcd", 40)+`","max_tokens":1}`))
				if err != nil {
					t.Fatal(err)
				}
				var ans struct {
					Usage usage `json:"usage"`
				}
				_ = json.NewDecoder(resp.Body).Decode(&ans)
				resp.Body.Close()
				cached = cachedTokens(ans.Usage)
			}
			if cached != tt.wantCached {
				t.Errorf("second answer's cached tokens %d, want %d (-1: no prompt_tokens_details)", cached, tt.wantCached)
			}
			cancel()
			if err := testutil.Recv(t, testutil.Timeout, done, "RunCommand's return"); err != nil {
				t.Errorf("RunCommand after cancel = %v, want nil", err)
			}
		})
	}
}

func TestRunCommandMooncakePrefillerHoldsFor480sUnlessTold(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flags []string
		want  float64 // seconds from now to remote_blocks_expiry_time
	}{
		{"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT by default", nil, 480},
		{"--kv-hold-timeout when given", []string{"--kv-hold-timeout", "7s"}, 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var stderr syncBuffer
			done := make(chan error, 1)
			args := append([]string{"--listen", "127.0.0.1:0", "--protocol", "mooncake", "--role", "prefill", "--bootstrap-port", "0",
				"--prefill-time", "0s", "--data-parallel-size", "2"}, tc.flags...)
			go func() { done <- RunCommand(ctx, args, io.Discard, &stderr) }()
			addr, boot := "", ""
			testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
				for _, line := range strings.Split(stderr.String(), "\n") {
					var entry struct {
						Msg  string `json:"msg"`
						Addr string `json:"addr"`
					}
					if json.Unmarshal([]byte(line), &entry) != nil {
						continue
					}
					switch entry.Msg {
					case "sim engine listening":
						addr = entry.Addr
					case "bootstrap server listening":
						boot = entry.Addr
					}
				}
				return addr != "" && boot != "", "no listening log lines; stderr:\n" + stderr.String()
			})
			client := &http.Client{Transport: &http.Transport{}}
			defer client.CloseIdleConnections()
			resp, err := client.Get("http://" + boot + "/query")
			if err != nil {
				t.Fatal(err)
			}
			var q map[string]struct {
				EngineID string `json:"engine_id"`
			}
			err = json.NewDecoder(resp.Body).Decode(&q)
			resp.Body.Close()
			if err != nil || len(q) != 2 || q["0"].EngineID == "" || q["1"].EngineID == "" {
				t.Fatalf("/query = %+v (%v), want two ranks with engine ids", q, err)
			}
			body := `{"prompt":"hello there","max_tokens":1,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-c"}}`
			resp, err = client.Post("http://"+addr+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			var c struct {
				KV struct {
					Expiry float64 `json:"remote_blocks_expiry_time"`
				} `json:"kv_transfer_params"`
			}
			err = json.NewDecoder(resp.Body).Decode(&c)
			resp.Body.Close()
			left := c.KV.Expiry - float64(time.Now().UnixNano())/1e9
			if err != nil || resp.StatusCode != http.StatusOK || left > tc.want || left < tc.want-5 {
				t.Errorf("prefill answered %d, hold ends in %.1fs (%v); want %.0fs", resp.StatusCode, left, err, tc.want)
			}
			cancel()
			if err := testutil.Recv(t, testutil.Timeout, done, "RunCommand's return"); err != nil {
				t.Errorf("RunCommand after cancel = %v, want nil", err)
			}
		})
	}
}

// runCommandAddr starts RunCommand with args and returns the address it
// logged and the channel of its return.
func runCommandAddr(t *testing.T, ctx context.Context, args ...string) (string, <-chan error) {
	t.Helper()
	var stderr syncBuffer
	done := make(chan error, 1)
	go func() { done <- RunCommand(ctx, args, io.Discard, &stderr) }()
	addr := ""
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		for _, line := range strings.Split(stderr.String(), "\n") {
			var entry struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if json.Unmarshal([]byte(line), &entry) == nil && entry.Msg == "sim engine listening" {
				addr = entry.Addr
			}
		}
		return addr != "", "no listening log line; stderr:\n" + stderr.String()
	})
	return addr, done
}

func TestRunCommandDrainsOnCancelWithShutdownTimeout(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	addr, done := runCommandAddr(t, ctx, "--listen", "127.0.0.1:0", "--itl", "5ms", "--shutdown-timeout", "5s")
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	stream := openStream(t, client, "http://"+addr, `{"prompt":"hi","max_tokens":40,"ignore_eos":true,"stream":true}`, nil)
	<-stream
	cancel() // what SIGTERM does to proxy sim
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		code, _ := status(t, client, http.MethodGet, "http://"+addr+"/health", "")
		return code == http.StatusServiceUnavailable, "health still answers " + http.StatusText(code)
	})
	if evs := drainEvents(t, stream); len(evs) == 0 || evs[len(evs)-1] != "[DONE]" {
		t.Errorf("a stream in flight at SIGTERM ended with %q, want [DONE] within the shutdown timeout", evs[max(len(evs)-1, 0):])
	}
	if err := testutil.Recv(t, testutil.Timeout, done, "RunCommand's return"); err != nil {
		t.Errorf("RunCommand after a drain = %v, want nil", err)
	}
}

func TestRunCommandExitsWithAnErrorWhenItsEngineDies(t *testing.T) {
	addr, done := runCommandAddr(t, context.Background(), "--listen", "127.0.0.1:0", "--itl", "1ms", "--die-after", "2")
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	checkCut(t, "the stream that killed proxy sim", drainEvents(t, openStream(t, client, "http://"+addr, `{"prompt":"hi","max_tokens":10,"ignore_eos":true,"stream":true}`, nil)))
	if err := testutil.Recv(t, testutil.Timeout, done, "RunCommand's return"); err == nil {
		t.Error("RunCommand returned nil after its engine died, want an error: a crashed process exits non-zero")
	}
}
