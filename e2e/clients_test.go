package e2e

// Real clients against the proxy: curl as the README shows it, Go's HTTP/1.1 connection pool
// and an HTTP/2-only client. The OpenAI SDK has its own test in proxy_test.go.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
)

// longStream is a streaming completion that goes on far longer than any test.
const longStream = `{"model":"sim","prompt":"tell me everything","max_tokens":100000,"ignore_eos":true,"stream":true}`

// slowDecoder makes the embedded default quick, with a decoder that streams one token every
// 5ms: a long stream is still running when a client gives up on it.
func slowDecoder(c *app.Config) {
	fastSims(c)
	c.Sims[1].ITL = 5 * time.Millisecond
}

// readDataLines reads n SSE data lines of a stream, failing the test if it ends first.
func readDataLines(t *testing.T, br *bufio.Reader, n int) {
	t.Helper()
	for got := 0; got < n; {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("stream ended after %d data lines: %v", got, err)
		}
		if strings.HasPrefix(line, "data: {") {
			got++
		}
	}
}

// decoderAbortedAndFree waits until the decoder has aborted abortsWanted requests in all
// and holds no block and runs nothing.
func decoderAbortedAndFree(t *testing.T, d string, abortsWanted int) {
	t.Helper()
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		st := kv(t, d)
		return st.AbortedTotal == abortsWanted && st.BlocksFree == st.BlocksTotal && st.RunningRequests == 0, "decoder: " + jsonString(st)
	})
}

func TestCurlKilledMidStreamAbortsTheDecodeAndFreesItsKV(t *testing.T) {
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Fatalf("this test drives curl, which is not on PATH (.ci/run installs it): %v", err)
	}
	s := startStack(t, slowDecoder)
	d := s.m.SimURLs("decode")[0]
	// As the README tells users to run it.
	cmd := exec.Command(curl, "-N", "-sS", s.url+"/v1/completions", "-d", longStream)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	readDataLines(t, bufio.NewReader(out), 3)
	if st := kv(t, d); st.RunningRequests != 1 || st.BlocksFree == st.BlocksTotal {
		t.Fatalf("decoder is not streaming to curl: %s", jsonString(st))
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	decoderAbortedAndFree(t, d, 1)
	// The decoder's connection closes with the client's context, a moment before the
	// handler counts the abort: the count may trail the engine's.
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		got := testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "decoding"})
		return got == 1, fmt.Sprintf("pdproxy_aborts_total{stage=decoding} = %v, want 1", got)
	})
	if stderr.Len() != 0 {
		t.Errorf("curl complained before it was killed: %s", stderr.String())
	}
	s.assertQuiet(time.Second)
}

// tracedPost sends a completion on client and reports whether it went over a connection
// that served a request before, and that connection's local address.
func tracedPost(t *testing.T, ctx context.Context, client *http.Client, url, body string) (resp *http.Response, reused bool, local string) {
	t.Helper()
	trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) {
		reused, local = i.Reused, i.Conn.LocalAddr().String()
	}}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err = client.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return resp, reused, local
}

// readOK reads a whole answer and fails the test unless it is a 200 that ends well: a JSON
// completion, or a stream ending in [DONE].
func readOK(t *testing.T, resp *http.Response) {
	t.Helper()
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d, %v: %s", resp.StatusCode, err, body)
	}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		if !bytes.HasSuffix(body, []byte("data: [DONE]\n\n")) {
			t.Fatalf("stream does not end with [DONE]: %s", body)
		}
		return
	}
	var c completion
	if err := json.Unmarshal(body, &c); err != nil || len(c.Choices) != 1 || c.Choices[0].Text == "" {
		t.Fatalf("not a completion (%v): %s", err, body)
	}
}

func TestKeepAliveConnectionsAreReusedAfterAStreamEndsEarly(t *testing.T) {
	t.Run("a stream the client cancelled leaves the pool's other connection working", func(t *testing.T) {
		s := startStack(t, slowDecoder)
		d := s.m.SimURLs("decode")[0]
		tr := &http.Transport{MaxIdleConnsPerHost: 4}
		t.Cleanup(tr.CloseIdleConnections)
		client := &http.Client{Transport: tr}

		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		stream, _, streamConn := tracedPost(t, ctx, client, s.url+"/v1/completions", longStream)
		readDataLines(t, bufio.NewReader(stream.Body), 3)
		// A second request while the stream runs opens a second connection, which goes back
		// to the pool idle once it is answered.
		resp, _, idleConn := tracedPost(t, context.Background(), client, s.url+"/v1/completions", `{"model":"sim","prompt":"hi","max_tokens":3,"ignore_eos":true}`)
		readOK(t, resp)
		if idleConn == streamConn {
			t.Fatalf("the second request shared the streaming connection %s", streamConn)
		}
		cancel()
		stream.Body.Close()
		decoderAbortedAndFree(t, d, 1)

		resp, reused, conn := tracedPost(t, context.Background(), client, s.url+"/v1/completions", `{"model":"sim","prompt":"again","max_tokens":3,"ignore_eos":true}`)
		readOK(t, resp)
		if !reused || conn != idleConn {
			t.Errorf("the request after the cancel went over %s (reused %v), want the kept-alive %s", conn, reused, idleConn)
		}
		s.assertQuiet(time.Second)
	})
	t.Run("a stream the decoder broke ends cleanly and its connection serves the next request", func(t *testing.T) {
		s := startStack(t, func(c *app.Config) {
			fastSims(c)
			// The decoder cuts every answer after its fifth SSE event.
			c.Sims[1].CloseAfter = 5
		})
		tr := &http.Transport{MaxIdleConnsPerHost: 4}
		t.Cleanup(tr.CloseIdleConnections)
		client := &http.Client{Transport: tr}

		resp, _, first := tracedPost(t, context.Background(), client, s.url+"/v1/completions", longStream)
		events := sseEvents(t, resp.Body)
		resp.Body.Close()
		if len(events) == 0 || !strings.Contains(events[len(events)-1], `"error"`) {
			t.Fatalf("a stream the decoder cut does not end in an error event: %q", events)
		}
		// Three events: two tokens and [DONE], under the decoder's cut.
		resp, reused, conn := tracedPost(t, context.Background(), client, s.url+"/v1/completions",
			`{"model":"sim","prompt":"short","max_tokens":2,"ignore_eos":true,"stream":true}`)
		readOK(t, resp)
		if !reused || conn != first {
			t.Errorf("the next request went over %s (reused %v), want the kept-alive %s", conn, reused, first)
		}
		s.assertQuiet(time.Second)
	})
}

// h2cClient speaks HTTP/2 only, without TLS (prior knowledge), as gRPC-style clients do.
func h2cClient(t *testing.T) *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: &p}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func TestHTTP2ClientStreamsAndCancelsOverOneConnection(t *testing.T) {
	s := startStack(t, slowDecoder)
	d := s.m.SimURLs("decode")[0]
	client := h2cClient(t)

	t.Run("a streaming completion arrives over HTTP/2", func(t *testing.T) {
		resp, _, _ := tracedPost(t, context.Background(), client, s.url+"/v1/completions",
			`{"model":"sim","prompt":"count","max_tokens":6,"ignore_eos":true,"stream":true}`)
		defer resp.Body.Close()
		if resp.ProtoMajor != 2 {
			t.Fatalf("answered over %s, want HTTP/2", resp.Proto)
		}
		events := sseEvents(t, resp.Body)
		if len(events) != 7 || events[6] != "[DONE]" {
			t.Fatalf("want 6 token events and [DONE], got %q", events)
		}
	})
	t.Run("a cancelled stream frees the KV and the connection lives on", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		stream, _, conn := tracedPost(t, ctx, client, s.url+"/v1/completions", longStream)
		if stream.ProtoMajor != 2 {
			t.Fatalf("answered over %s, want HTTP/2", stream.Proto)
		}
		readDataLines(t, bufio.NewReader(stream.Body), 3)
		cancel()
		stream.Body.Close()
		decoderAbortedAndFree(t, d, 1)
		// HTTP/2 cancels a stream with RST_STREAM, not by closing the connection: the next
		// request shares it.
		resp, reused, again := tracedPost(t, context.Background(), client, s.url+"/v1/completions", `{"model":"sim","prompt":"hi","max_tokens":3,"ignore_eos":true}`)
		readOK(t, resp)
		if !reused || again != conn {
			t.Errorf("the request after the cancel went over %s (reused %v), want the HTTP/2 connection %s", again, reused, conn)
		}
	})
	s.assertQuiet(time.Second)
}
