package faultengine

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if an engine's goroutine outlives its test.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// testDeadline bounds every wait here; no test measures speed against it.
const testDeadline = 10 * time.Second

// post writes a completion request on c.
func post(t *testing.T, c net.Conn) {
	t.Helper()
	body := `{"model":"m","prompt":"hello","max_tokens":8}`
	if _, err := fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body); err != nil {
		t.Fatalf("write request: %v", err)
	}
}

// TestEveryFaultIsSignalledBeforeItStrikes: the engine calls OnFault with its fault once per
// request it misbehaves on, and, but for LateEnd (whose fault is the end it withholds after
// the rest), before the peer got a byte of the answer: a test that acts on the signal acts
// before the fault can have any effect.
func TestEveryFaultIsSignalledBeforeItStrikes(t *testing.T) {
	for _, f := range Faults() {
		t.Run(string(f), func(t *testing.T) {
			struck := make(chan Fault, 4)
			resume := make(chan struct{})
			e, err := Start(Config{Protocol: VLLM, Prefill: f == BadParams, Fault: f, OnFault: func(f Fault) {
				struck <- f
				<-resume
			}})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			c, err := net.Dial("tcp", e.ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			br := bufio.NewReader(c)
			post(t, c)
			if f == KeepAliveReset {
				// Its fault is on the kept-open connection, as the next request arrives.
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatalf("the first answer: %v", err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				post(t, c)
			}
			select {
			case got := <-struck:
				if got != f {
					t.Fatalf("signalled %q", got)
				}
			case <-time.After(testDeadline):
				t.Fatal("the fault was never signalled")
			}
			select {
			case <-e.Faulted():
			default:
				t.Error("Faulted is not closed once the fault was signalled")
			}
			if f != LateEnd {
				// Nothing may have arrived while the signal is being handled; a short wait
				// can only miss a byte, never invent one.
				c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
				if _, err := br.Peek(1); !errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("the peer got a byte of the answer before the signal returned (%v)", err)
				}
				c.SetReadDeadline(time.Time{})
			}
			close(resume)
			if len(struck) != 0 {
				t.Errorf("one faulty request was signalled %d more times", len(struck))
			}
		})
	}
}

// TestBigHeadersAnswerWholeUnderAnOversizedHead: BigHeaders is a whole, normal answer whose
// head carries 150 extra lines and one of 5 KiB.
func TestBigHeadersAnswerWholeUnderAnOversizedHead(t *testing.T) {
	e, err := Start(Config{Protocol: VLLM, Fault: BigHeaders})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	c, err := net.Dial("tcp", e.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(testDeadline))
	post(t, c)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("the answer: %v", err)
	}
	defer resp.Body.Close()
	notes := 0
	for k := range resp.Header {
		if strings.HasPrefix(k, "X-Engine-Note-") {
			notes++
		}
	}
	if notes != 150 || len(resp.Header.Get("X-Engine-Big")) != 5<<10 {
		t.Fatalf("%d note lines and a big one of %d bytes, want 150 and 5 KiB", notes, len(resp.Header.Get("X-Engine-Big")))
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 || !strings.Contains(string(b), `"text":"hello"`) {
		t.Fatalf("status %d, %q (%v): want the whole completion", resp.StatusCode, b, err)
	}
}
