package proxy

import (
	"bytes"
	"context"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// twoModelHarness is a harness whose decoders serve one model each: d0 "m", d1 "n".
func twoModelHarness(t *testing.T, cfg Config, d0, d1 *fakeEngine) *harness {
	t.Helper()
	a, b := decoder("d0", d0.URL()), decoder("d1", d1.URL())
	a.Models, b.Models = []string{"m"}, []string{"n"}
	return newHarness(t, cfg, routerconfig.Config{Backends: []routerconfig.BackendConfig{a, b}})
}

// passAnswer answers as a vLLM pooling route does: JSON naming the model it was asked for,
// with a header of the engine's own and one the Connection header makes hop-by-hop.
func passAnswer(w http.ResponseWriter, r *http.Request, body []byte) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Engine", "yes")
	h.Set("Connection", "X-Hop")
	h.Set("X-Hop", "no")
	model := "none"
	if f := passField(body, "model"); f != nil {
		model = strings.Trim(string(f), `"`)
	}
	io.WriteString(w, `{"object":"list","model":"`+model+`","path":"`+r.URL.Path+`","data":[{"index":0,"embedding":[0.5,-1.25]}]}`)
}

func passField(body []byte, name string) []byte {
	i := bytes.Index(body, []byte(`"`+name+`":`))
	if i < 0 {
		return nil
	}
	rest := body[i+len(name)+3:]
	j := bytes.IndexAny(rest, ",}")
	return bytes.TrimSpace(rest[:j])
}

func TestPassthroughRoutesReachAnEngineServingTheModel(t *testing.T) {
	d0, d1 := newEngine(t, passAnswer), newEngine(t, passAnswer)
	h := twoModelHarness(t, Config{}, d0, d1)
	for _, p := range passthroughRoutes {
		if p.body == passMultipart {
			continue // TestTranscriptionPassesThroughWithItsFileIntact
		}
		t.Run(strings.TrimPrefix(p.path, "/"), func(t *testing.T) {
			body := `{"model":"n","input":["a b", "c"],"x_unknown":{"k":[1,2]}}`
			resp, got := h.post(p.path, body)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			want := `{"object":"list","model":"n","path":"` + p.path + `","data":[{"index":0,"embedding":[0.5,-1.25]}]}`
			if string(got) != want {
				t.Errorf("answer %s, want the engine's %s", got, want)
			}
			if resp.Header.Get("X-Engine") != "yes" || resp.Header.Get("X-Hop") != "" {
				t.Errorf("engine headers passed on: X-Engine %q (want yes), X-Hop %q (want none: hop-by-hop)", resp.Header.Get("X-Engine"), resp.Header.Get("X-Hop"))
			}
			calls := d1.callsTo(p.path)
			if len(calls) != 1 || len(d0.callsTo(p.path)) != 0 {
				t.Fatalf("the engine serving n got %d calls, the other %d; want 1 and 0", len(calls), len(d0.callsTo(p.path)))
			}
			if string(calls[0].Body) != body {
				t.Errorf("engine got %s, want the client's bytes %s", calls[0].Body, body)
			}
			if ct := calls[0].Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("engine got Content-Type %q", ct)
			}
			if n := h.value("pdproxy_requests_total", map[string]string{"route": p.path, "code": "200", "model": "n"}); n != 1 {
				t.Errorf("pdproxy_requests_total{route=%s,code=200,model=n} = %v, want 1", p.path, n)
			}
		})
	}
	h.waitQuiet()
}

func TestTokenizeWithoutModelGoesToAnyDecoder(t *testing.T) {
	d0, d1 := newEngine(t, passAnswer), newEngine(t, passAnswer)
	h := twoModelHarness(t, Config{}, d0, d1)
	for _, path := range []string{"/tokenize", "/detokenize"} {
		resp, got := h.post(path, `{"prompt":"hello"}`)
		if resp.StatusCode != 200 || !strings.Contains(string(got), `"model":"none"`) {
			t.Errorf("%s without a model: status %d: %s", path, resp.StatusCode, got)
		}
	}
	// Embeddings need a model: there is no telling which engine's the client means.
	resp, body := h.post("/v1/embeddings", `{"input":"hello"}`)
	if _, _, _, param := checkOpenAIError(t, resp, body, 400); param == nil || *param != "model" {
		t.Errorf("param %v, want model", param)
	}
	h.waitQuiet()
}

func TestPassthroughAliasRewrittenInAndOut(t *testing.T) {
	d0, d1 := newEngine(t, passAnswer), newEngine(t, passAnswer)
	h := twoModelHarness(t, Config{ModelAliases: map[string]Alias{"embedder": {{Model: "n"}}}}, d0, d1)
	resp, got := h.post("/v1/embeddings", `{"input":"x","model":"embedder","dimensions":2}`)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, got)
	}
	if !strings.Contains(string(got), `"model":"embedder"`) || strings.Contains(string(got), `"model":"n"`) {
		t.Errorf("answer %s does not name the client's alias", got)
	}
	calls := d1.callsTo("/v1/embeddings")
	if len(calls) != 1 {
		t.Fatalf("the engine serving n got %d calls", len(calls))
	}
	if want := `{"input":"x","model":"n","dimensions":2}`; !jsonEqual(t, calls[0].Body, []byte(want)) {
		t.Errorf("engine got %s, want %s", calls[0].Body, want)
	}
	if n := h.value("pdproxy_requests_total", map[string]string{"route": "/v1/embeddings", "model": "embedder"}); n != 1 {
		t.Errorf("requests counted under the alias: %v, want 1", n)
	}
	h.waitQuiet()
}

func TestPassthroughRefusals(t *testing.T) {
	d0, d1 := newEngine(t, passAnswer), newEngine(t, passAnswer)
	h := twoModelHarness(t, Config{MaxBodyBytes: 1 << 10}, d0, d1)
	cases := []struct {
		name, path, ctype, body string
		status                  int
		code                    string
	}{
		{"a model nobody serves is 404", "/v1/embeddings", "application/json", `{"model":"ghost","input":"x"}`, 404, "model_not_found"},
		{"a tokenize for a model nobody serves is 404", "/tokenize", "application/json", `{"model":"ghost","prompt":"x"}`, 404, "model_not_found"},
		{"an oversized body is 413", "/v1/score", "application/json", `{"model":"m","text_1":"` + strings.Repeat("a", 2<<10) + `"}`, 413, "request_too_large"},
		{"a body that is not JSON is 400", "/rerank", "application/json", `model=m`, 400, "invalid_value"},
		{"a JSON array is 400", "/pooling", "application/json", `[{"model":"m"}]`, 400, "invalid_value"},
		{"a model that is no string is 400", "/classify", "application/json", `{"model":7,"input":"x"}`, 400, "invalid_value"},
		{"a transcription that is not multipart is 400", "/v1/audio/transcriptions", "application/json", `{"model":"m"}`, 400, "invalid_content_type"},
		{"a transcription without a model is 400", "/v1/audio/transcriptions", "multipart/form-data; boundary=XX", "--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--XX--\r\n", 400, "invalid_value"},
		{"a broken multipart body is 400", "/v1/audio/transcriptions", "multipart/form-data; boundary=XX", "--XX\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm", 400, "invalid_value"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			resp, body := h.do(http.MethodPost, c.path, c.body, http.Header{"Content-Type": {c.ctype}})
			if _, _, code, _ := checkOpenAIError(t, resp, body, c.status); code != c.code {
				t.Errorf("code %q, want %q", code, c.code)
			}
		})
	}
	// Neither engine got a call on any passthrough route, nor a generation.
	for name, e := range map[string]*fakeEngine{"d0": d0, "d1": d1} {
		n := len(e.generations())
		for _, p := range passthroughRoutes {
			n += len(e.callsTo(p.path))
		}
		if n != 0 {
			t.Errorf("engine %s got %d calls for refused requests", name, n)
		}
	}
	h.waitQuiet()
}

func TestPassthroughNeedsTheKey(t *testing.T) {
	t.Setenv("PDPROXY_TEST_PASS_KEYS", "k1")
	d := newEngine(t, passAnswer)
	h := aggregated(t, Config{APIKeysEnv: "PDPROXY_TEST_PASS_KEYS"}, d)
	resp, body := h.post("/v1/embeddings", `{"model":"m","input":"x"}`)
	checkOpenAIError(t, resp, body, 401)
	resp, body = h.do(http.MethodPost, "/v1/embeddings", `{"model":"m","input":"x"}`, http.Header{"Authorization": {"Bearer k1"}})
	if resp.StatusCode != 200 {
		t.Fatalf("with the key: status %d: %s", resp.StatusCode, body)
	}
	if calls := d.callsTo("/v1/embeddings"); len(calls) != 1 || calls[0].Header.Get("Authorization") != "" {
		t.Errorf("engine got %d calls, Authorization %q: the client's key is for the proxy", len(calls), calls[0].Header.Get("Authorization"))
	}
}

// transcriptionBody is a multipart transcription request: a file of every byte value, the
// model, and a field after them.
func transcriptionBody(t *testing.T, model string) (body []byte, ctype string, file []byte) {
	t.Helper()
	for i := range 3000 {
		file = append(file, byte(i*7))
	}
	var b bytes.Buffer
	mw := multipart.NewWriter(&b)
	fw, _ := mw.CreateFormFile("file", "speech.wav")
	fw.Write(file)
	mw.WriteField("model", model)
	mw.WriteField("response_format", "json")
	mw.Close()
	return b.Bytes(), mw.FormDataContentType(), file
}

// formParts reads a multipart body the engine got into its fields.
func formParts(t *testing.T, r received) map[string][]byte {
	t.Helper()
	_, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		t.Fatalf("engine's Content-Type %q: %v", r.Header.Get("Content-Type"), err)
	}
	mr := multipart.NewReader(bytes.NewReader(r.Body), params["boundary"])
	out := map[string][]byte{}
	for {
		p, err := mr.NextPart()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatalf("engine got a broken multipart body: %v", err)
		}
		out[p.FormName()], _ = io.ReadAll(p)
	}
}

func TestTranscriptionPassesThroughWithItsFileIntact(t *testing.T) {
	transcribe := func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"text":"hello","model":"n"}`)
	}
	d0, d1 := newEngine(t, transcribe), newEngine(t, transcribe)
	h := twoModelHarness(t, Config{ModelAliases: map[string]Alias{"whisper": {{Model: "n"}}}}, d0, d1)
	for _, c := range []struct{ name, model, wantModel string }{
		{"a served model: the bytes as they came", "n", "n"},
		{"an alias: the model field rewritten", "whisper", "whisper"},
	} {
		t.Run(c.name, func(t *testing.T) {
			body, ctype, file := transcriptionBody(t, c.model)
			before := len(d1.callsTo("/v1/audio/transcriptions"))
			resp, got := h.do(http.MethodPost, "/v1/audio/transcriptions", string(body), http.Header{"Content-Type": {ctype}})
			if resp.StatusCode != 200 || string(got) != `{"text":"hello","model":"`+c.wantModel+`"}` {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			calls := d1.callsTo("/v1/audio/transcriptions")
			if len(calls) != before+1 {
				t.Fatalf("the engine serving n got %d calls, want 1", len(calls)-before)
			}
			r := calls[len(calls)-1]
			if c.model == "n" && (!bytes.Equal(r.Body, body) || r.Header.Get("Content-Type") != ctype) {
				t.Errorf("a body with nothing to rewrite was changed")
			}
			f := formParts(t, r)
			if !bytes.Equal(f["file"], file) {
				t.Errorf("the file's bytes changed on the way (%d bytes, want %d)", len(f["file"]), len(file))
			}
			if string(f["model"]) != "n" || string(f["response_format"]) != "json" {
				t.Errorf("engine got model %q, response_format %q", f["model"], f["response_format"])
			}
		})
	}
	h.waitQuiet()
}

func TestPassthroughClientLeavingClosesTheEngineCall(t *testing.T) {
	called, ended := make(chan struct{}), make(chan struct{})
	var d *fakeEngine
	d = newEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		close(called)
		d.wait(r, nil)
		if r.Context().Err() != nil {
			close(ended)
		}
	})
	h := aggregated(t, Config{}, d)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/embeddings", `{"model":"m","input":"x"}`, nil))
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	closedWithin(t, called, "the engine got the call")
	cancel()
	closedWithin(t, ended, "the engine's request context ended as the client left")
	if err := <-errc; err == nil {
		t.Errorf("the client that left got an answer")
	}
	h.waitQuiet()
	// The request is counted as its handler returns, a moment after the table let it go.
	eventually(t, "pdproxy_requests_total{code=499} to count the request", func() bool {
		return h.value("pdproxy_requests_total", map[string]string{"route": "/v1/embeddings", "code": "499"}) == 1
	})
	for _, code := range []string{"error", "500", "502", "504"} {
		if v := h.value("pdproxy_backend_requests_total", map[string]string{"backend": "d0", "code": code}); v != 0 {
			t.Errorf("a client leaving was charged to the engine: code %s %v", code, v)
		}
	}
}

func TestPassthroughEngineFailures(t *testing.T) {
	cases := []struct {
		name    string
		handler engineHandler
		status  int
	}{
		{"a 500 is 502", answer(500, "application/json", `{"error":{"message":"boom"}}`), 502},
		{"a 400 is the engine's own", answer(400, "application/json", `{"error":{"message":"bad input","type":"BadRequestError","param":null,"code":400}}`), 400},
		{"a reset is 502", func(w http.ResponseWriter, r *http.Request, _ []byte) { panic(http.ErrAbortHandler) }, 502},
		{"silence is 504", func(w http.ResponseWriter, r *http.Request, _ []byte) {
			select {
			case <-r.Context().Done():
			case <-time.After(testDeadline):
			}
		}, 504},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			bad, good := newEngine(t, c.handler), newEngine(t, passAnswer)
			a, b := decoder("d0", bad.URL()), decoder("d1", good.URL())
			a.Models, b.Models = []string{"m"}, []string{"n"}
			h := newHarness(t, Config{DecodeFirstByteTimeout: 200 * time.Millisecond},
				routerconfig.Config{Backends: []routerconfig.BackendConfig{a, b}})
			resp, body := h.post("/v1/rerank", `{"model":"m","query":"q","documents":["a"]}`)
			checkOpenAIError(t, resp, body, c.status)
			h.waitQuiet()
			for _, code := range []string{"error", "500", "502", "504"} {
				if v := h.value("pdproxy_backend_requests_total", map[string]string{"backend": "d1", "code": code}); v != 0 {
					t.Errorf("the healthy engine was charged: code %s %v", code, v)
				}
			}
			if c.status >= 500 {
				v := h.value("pdproxy_backend_requests_total", map[string]string{"backend": "d0", "code": "500"}) +
					h.value("pdproxy_backend_requests_total", map[string]string{"backend": "d0", "code": "504"}) +
					h.value("pdproxy_backend_requests_total", map[string]string{"backend": "d0", "code": "error"})
				if v != 1 {
					t.Errorf("the failing engine was charged %v failures, want 1", v)
				}
			}
		})
	}
}

// FuzzMultipartModel: whatever the body, reading its model never panics, and a body it
// accepts is rewritten to name another model with every other part as it came.
func FuzzMultipartModel(f *testing.F) {
	body, ctype, _ := transcriptionBody(&testing.T{}, "whisper")
	_, params, _ := mime.ParseMediaType(ctype)
	f.Add(body, params["boundary"])
	f.Add([]byte("--XX\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--XX--\r\n"), "XX")
	f.Add([]byte("--XX\r\nContent-Disposition: form-data; name=\"model\"\r\nContent-Transfer-Encoding: quoted-printable\r\n\r\nm=3D\r\n--XX--"), "XX")
	f.Fuzz(func(t *testing.T, body []byte, boundary string) {
		ctype := mime.FormatMediaType("multipart/form-data", map[string]string{"boundary": boundary})
		if ctype == "" {
			return
		}
		model, e := multipartModel(body, ctype)
		if e != nil {
			if e.Status != http.StatusBadRequest {
				t.Fatalf("status %d for a bad body", e.Status)
			}
			return
		}
		out, outType, err := multipartWithModel(body, ctype, "served")
		if err != nil {
			t.Fatalf("a body whose model %q was read could not be rewritten: %v", model, err)
		}
		if got, e := multipartModel(out, outType); e != nil || got != "served" {
			t.Fatalf("rewritten body names %q (%v)", got, e)
		}
		in, re := rawParts(t, body, ctype), rawParts(t, out, outType)
		if len(in) != len(re) {
			t.Fatalf("%d parts became %d", len(in), len(re))
		}
		for i := range in {
			if in[i].name != "model" && (in[i].name != re[i].name || !bytes.Equal(in[i].data, re[i].data)) {
				t.Fatalf("part %d (%q) changed: %q became %q", i, in[i].name, in[i].data, re[i].data)
			}
		}
	})
}

type rawPart struct {
	name string
	data []byte
}

func rawParts(t *testing.T, body []byte, ctype string) []rawPart {
	t.Helper()
	_, params, _ := mime.ParseMediaType(ctype)
	mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
	var out []rawPart
	for {
		p, err := mr.NextRawPart()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatalf("read parts: %v", err)
		}
		b, err := io.ReadAll(p)
		if err != nil {
			t.Fatalf("read part: %v", err)
		}
		out = append(out, rawPart{p.FormName(), b})
	}
}

func TestPassthroughRetriesAnEngineThatNeverTookTheCall(t *testing.T) {
	good := newEngine(t, passAnswer)
	down := decoder("d0", closedURL(t))
	down.Weight = 2 // least_inflight's ties go to the heavier: the dead engine is tried first
	h := newHarness(t, Config{}, routerconfig.Config{Backends: []routerconfig.BackendConfig{down, decoder("d1", good.URL())}})
	resp, body := h.post("/v1/embeddings", `{"model":"m","input":"x"}`)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if n := len(good.callsTo("/v1/embeddings")); n != 1 {
		t.Errorf("the live engine got %d calls, want 1", n)
	}
	if n := h.value("pdproxy_retries_total", map[string]string{"role": "decode"}); n != 1 {
		t.Errorf("pdproxy_retries_total{role=decode} = %v, want 1", n)
	}
	h.waitQuiet()
}
