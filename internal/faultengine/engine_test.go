package faultengine

import (
	"bufio"
	"encoding/json"
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

// post writes a completion request on c, streamed or not.
func post(t *testing.T, c net.Conn, stream bool) {
	t.Helper()
	body := `{"model":"m","prompt":"hello","max_tokens":8}`
	if stream {
		body = `{"model":"m","prompt":"hello","max_tokens":8,"stream":true}`
	}
	postBody(t, c, body)
}

func postBody(t *testing.T, c net.Conn, body string) {
	t.Helper()
	if _, err := fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body); err != nil {
		t.Fatalf("write request: %v", err)
	}
}

// TestEveryFaultIsSignalledBeforeItStrikes: the engine calls OnFault with its fault once per
// request it misbehaves on, and, but for LateEnd (whose fault is the end it withholds after
// the rest), before the peer got a byte of the answer: a test that acts on the signal acts
// before the fault can have any effect.
func TestEveryFaultIsSignalledBeforeItStrikes(t *testing.T) {
	for _, f := range append(Faults(), StreamFaults()...) {
		stream := f == ShortStream || f == MidError
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
			post(t, c, stream)
			if f == KeepAliveReset {
				// Its fault is on the kept-open connection, as the next request arrives.
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatalf("the first answer: %v", err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				post(t, c, stream)
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
	post(t, c, false)
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

// streamOf posts body to e's completions and returns the data of each event the stream
// carried, and the error that ended the read (nil for a clean end).
func streamOf(t *testing.T, e *Engine, path, body string) ([]string, error) {
	t.Helper()
	client := &http.Client{Timeout: testDeadline}
	resp, err := client.Post(e.URL()+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("post: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	var events []string
	for _, ev := range strings.Split(string(b), "\n\n") {
		if d, ok := strings.CutPrefix(ev, "data: "); ok {
			events = append(events, d)
		}
	}
	return events, err
}

// TestAStreamReportsItsIdsAndGoesOnFromThem: a stream asked for its token ids reports them as
// vLLM does, a stream's faults strike half way, and a completions prompt of the prompt's ids
// and those already generated goes on with the next token, as a continuation expects.
func TestAStreamReportsItsIdsAndGoesOnFromThem(t *testing.T) {
	type choice struct {
		Text         string `json:"text"`
		Delta        *struct{ Content string }
		FinishReason *string `json:"finish_reason"`
		TokenIDs     []int   `json:"token_ids"`
		PromptIDs    []int   `json:"prompt_token_ids"`
	}
	type event struct {
		PromptIDs []int           `json:"prompt_token_ids"`
		Choices   []choice        `json:"choices"`
		Error     json.RawMessage `json:"error"`
	}
	// summary is what a client reads: the tokens' text and ids, finish reasons, an error
	// event, [DONE], and how the read ended.
	summary := func(events []string, err error) string {
		var parts []string
		for _, d := range events {
			if d == "[DONE]" {
				parts = append(parts, "[DONE]")
				continue
			}
			var ev event
			if jerr := json.Unmarshal([]byte(d), &ev); jerr != nil {
				t.Fatalf("event %q: %v", d, jerr)
			}
			if ev.Error != nil {
				parts = append(parts, "error")
			}
			if ev.PromptIDs != nil {
				parts = append(parts, fmt.Sprintf("prompt%v", ev.PromptIDs))
			}
			for _, c := range ev.Choices {
				text := c.Text
				if c.Delta != nil {
					text = c.Delta.Content
				}
				if c.PromptIDs != nil {
					parts = append(parts, fmt.Sprintf("prompt%v", c.PromptIDs))
				}
				p := fmt.Sprintf("%s%v", text, c.TokenIDs)
				if c.FinishReason != nil {
					p += "/" + *c.FinishReason
				}
				parts = append(parts, p)
			}
		}
		if err != nil {
			parts = append(parts, "cut")
		}
		return strings.Join(parts, " ")
	}
	for _, tc := range []struct {
		name  string
		fault Fault
		path  string
		body  string
		want  string
	}{
		{"whole, with ids", None, "/v1/completions", `{"prompt":"hi","max_tokens":8,"stream":true,"return_token_ids":true}`,
			"prompt[104 105] t0[1000] t1[1001] t2[1002] t3[1003]/stop [DONE]"},
		{"without ids unless asked", None, "/v1/completions", `{"prompt":"hi","stream":true}`, "t0[] t1[] t2[] t3[]/stop [DONE]"},
		{"a chat's prompt ids at the top of its first chunk", None, "/v1/chat/completions",
			`{"messages":[],"max_completion_tokens":2,"stream":true,"return_token_ids":true}`, "prompt[91 93] t0[1000] t1[1001]/length [DONE]"},
		{"max_tokens ends it first", None, "/v1/completions", `{"prompt":"hi","max_tokens":3,"stream":true}`, "t0[] t1[] t2[]/length [DONE]"},
		{"a prompt of ids goes on where its generated ids leave off", None, "/v1/completions",
			`{"prompt":[104,105,1000,1001],"max_tokens":6,"stream":true,"return_token_ids":true}`, "prompt[104 105 1000 1001] t2[1002] t3[1003]/stop [DONE]"},
		{"mid_reset: half the tokens, then the reset", MidReset, "/v1/completions", `{"prompt":"hi","stream":true}`, "t0[] t1[] cut"},
		{"mid_close: half the tokens, then the close", MidClose, "/v1/completions", `{"prompt":"hi","stream":true}`, "t0[] t1[] cut"},
		{"short_stream: half the tokens, then a clean end", ShortStream, "/v1/completions", `{"prompt":"hi","stream":true}`, "t0[] t1[]"},
		{"mid_error: half the tokens, an error event, [DONE]", MidError, "/v1/chat/completions", `{"messages":[],"stream":true}`, "t0[] t1[] error [DONE]"},
		{"no_done: every token, then a clean end", NoDone, "/v1/completions", `{"prompt":"hi","stream":true}`, "t0[] t1[] t2[] t3[]/stop"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, err := Start(Config{Protocol: VLLM, Fault: tc.fault})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			if got := summary(streamOf(t, e, tc.path, tc.body)); got != tc.want {
				t.Errorf("the client read %q, want %q", got, tc.want)
			}
		})
	}
}
