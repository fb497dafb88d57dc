package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// builtDir is where buildBinary put the binary, removed when the tests end.
var builtDir string

// buildBinary builds cmd/proxy once for the tests that run it as a user would.
var buildBinary = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "pdproxy-bin")
	if err != nil {
		return "", err
	}
	builtDir = dir
	bin := filepath.Join(dir, "proxy")
	cmd := exec.Command("go", "build", "-o", bin, "../cmd/proxy")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", &buildError{string(out), err}
	}
	return bin, nil
})

type buildError struct {
	out string
	err error
}

func (e *buildError) Error() string { return "go build ./cmd/proxy: " + e.err.Error() + "\n" + e.out }

// process is the built binary running, with its JSON log lines collected.
type process struct {
	t     *testing.T
	cmd   *exec.Cmd
	mu    sync.Mutex
	lines []map[string]any
	raw   bytes.Buffer
	addrs chan string
	done  chan error
}

// startProcess runs the binary with args and waits until it logs that it listens; msg is the
// log message carrying the address in its "addr" field.
func startProcess(t *testing.T, msg string, args ...string) (*process, string) {
	t.Helper()
	bin, err := buildBinary()
	if err != nil {
		t.Fatal(err)
	}
	p := &process{t: t, cmd: exec.Command(bin, args...), addrs: make(chan string, 1), done: make(chan error, 1)}
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var line map[string]any
			p.mu.Lock()
			p.raw.WriteString(sc.Text() + "\n")
			if json.Unmarshal(sc.Bytes(), &line) == nil {
				p.lines = append(p.lines, line)
				if line["msg"] == msg {
					if a, ok := line["addr"].(string); ok {
						select {
						case p.addrs <- a:
						default:
						}
					}
				}
			}
			p.mu.Unlock()
		}
	}()
	go func() {
		<-readDone
		p.done <- p.cmd.Wait()
	}()
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			p.cmd.Process.Kill()
			<-p.done
		}
	})
	select {
	case a := <-p.addrs:
		return p, a
	case err := <-p.done:
		t.Fatalf("%s exited before listening: %v\n%s", bin, err, p.log())
	case <-time.After(20 * time.Second):
		t.Fatalf("%s did not log %q in 20s:\n%s", bin, msg, p.log())
	}
	return nil, ""
}

func (p *process) log() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.raw.String()
}

// stop sends sig and returns the exit code.
func (p *process) stop(sig os.Signal) int {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatal(err)
	}
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		p.t.Fatalf("no exit 20s after %v:\n%s", sig, p.log())
	}
	return p.cmd.ProcessState.ExitCode()
}

func completionOK(t *testing.T, base string) {
	t.Helper()
	resp := post(t, context.Background(), base+"/v1/completions", `{"model":"sim","prompt":"hello","max_tokens":5}`)
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || !bytes.Contains(body, []byte(`"text"`)) {
		t.Fatalf("completion through %s: %d %s", base, resp.StatusCode, body)
	}
}

func TestCommandServesTheEmbeddedDefaultAndExitsCleanly(t *testing.T) {
	for _, sig := range []os.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			p, addr := startProcess(t, "proxy listening", "--listen", "127.0.0.1:0", "--log-format", "json")
			completionOK(t, "http://"+addr)
			if code := p.stop(sig); code != 0 {
				t.Fatalf("exit code %d after %v, want 0:\n%s", code, sig, p.log())
			}
			if !strings.Contains(p.log(), `"request_id"`) {
				t.Errorf("no request log line:\n%s", p.log())
			}
			if _, err := http.Get("http://" + addr + "/health"); err == nil {
				t.Error("still serving after exit")
			}
		})
	}
}

func TestSimSubcommandsMakeAMultiProcessDeployment(t *testing.T) {
	pp, pAddr := startProcess(t, "sim engine listening", "sim", "--role", "prefill", "--listen", "127.0.0.1:0", "--prefill-time", "1ms")
	dp, dAddr := startProcess(t, "sim engine listening", "sim", "--role", "decode", "--listen", "127.0.0.1:0", "--itl", "1ms")
	px, addr := startProcess(t, "proxy listening", "--prefill", "http://"+pAddr, "--decode", "http://"+dAddr, "--listen", "127.0.0.1:0", "--log-format", "json")
	completionOK(t, "http://"+addr)
	for _, a := range []string{pAddr, dAddr} {
		if st := kv(t, "http://"+a); st.RequestsTotal != 1 || st.BlocksFree != st.BlocksTotal {
			t.Errorf("engine %s: %+v, want one request served and every block free", a, st)
		}
	}
	for _, p := range []*process{px, pp, dp} {
		if code := p.stop(syscall.SIGTERM); code != 0 {
			t.Errorf("exit code %d:\n%s", code, p.log())
		}
	}
}

func TestSimHelpDocumentsEveryFlag(t *testing.T) {
	bin, err := buildBinary()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bin, "sim", "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("proxy sim --help: %v\n%s", err, out)
	}
	for _, f := range []string{"-role", "-listen", "-model", "-kv-blocks", "-block-size", "-prefill-time", "-itl", "-max-running", "-kv-hold-timeout", "-kv-transfer-time"} {
		if !bytes.Contains(out, []byte(f+" ")) {
			t.Errorf("proxy sim --help does not document %s:\n%s", f, out)
		}
	}
}

func TestBadConfigIsRejectedNamingTheKey(t *testing.T) {
	bin, err := buildBinary()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	file := filepath.Join(dir, "bad.yaml")
	os.WriteFile(file, []byte("listen: 127.0.0.1:0\nkv_hold_timout: 10s\n"), 0o644)
	out, err := exec.Command(bin, "--config", file).CombinedOutput()
	if err == nil {
		t.Fatalf("started with an unknown key:\n%s", out)
	}
	if !bytes.Contains(out, []byte("kv_hold_timout")) || !bytes.Contains(out, []byte("line 2")) {
		t.Fatalf("error does not name the key and its line:\n%s", out)
	}
}
