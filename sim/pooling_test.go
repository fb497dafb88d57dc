package sim

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"
	"time"
)

// multipartBody is a transcription form: a file of size bytes and fields.
func multipartBody(t *testing.T, size int, fields map[string]string) (string, string) {
	t.Helper()
	var b bytes.Buffer
	mw := multipart.NewWriter(&b)
	fw, err := mw.CreateFormFile("file", "audio.wav")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = fw.Write(bytes.Repeat([]byte{7}, size))
	for k, v := range fields {
		_ = mw.WriteField(k, v)
	}
	_ = mw.Close()
	return b.String(), mw.FormDataContentType()
}

func unitNorm(v []float64) bool {
	n := 0.0
	for _, x := range v {
		n += x * x
	}
	return math.Abs(n-1) < 1e-9
}

func TestPoolingRoutesAnswerInVLLMsShapes(t *testing.T) {
	ts := startServer(t, fastConfig())
	embedding := func(t *testing.T, body string) []float64 {
		t.Helper()
		var r struct {
			Object string `json:"object"`
			Data   []struct {
				Object    string    `json:"object"`
				Index     int       `json:"index"`
				Embedding []float64 `json:"embedding"`
			} `json:"data"`
			Usage struct {
				PromptTokens int `json:"prompt_tokens"`
				TotalTokens  int `json:"total_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(postOK(t, ts.client, ts.srv.URL+"/v1/embeddings", body), &r); err != nil || r.Object != "list" || len(r.Data) == 0 || r.Data[0].Object != "embedding" {
			t.Fatalf("embeddings of %s answered %+v (%v)", body, r, err)
		}
		return r.Data[0].Embedding
	}
	hello := Tokenize("hello world")
	ids, _ := json.Marshal(hello)

	t.Run("embeddings are unit vectors of --embedding-dim from the tokens", func(t *testing.T) {
		a := embedding(t, `{"model":"sim","input":"hello world"}`)
		if len(a) != 16 || !unitNorm(a) {
			t.Fatalf("embedding %v: want 16 floats of norm 1", a)
		}
		if b := embedding(t, `{"input":[`+string(ids)+`]}`); fmt.Sprint(a) != fmt.Sprint(b) {
			t.Errorf("the text's token ids embed to %v, the text to %v", b, a)
		}
		if c := embedding(t, `{"input":"hello there"}`); fmt.Sprint(a) == fmt.Sprint(c) {
			t.Errorf("two texts embed alike: %v", a)
		}
		if d := embedding(t, `{"input":"hello world","dimensions":4}`); len(d) != 4 || !unitNorm(d) {
			t.Errorf("dimensions 4: %v", d)
		}
	})
	t.Run("embeddings of several inputs and base64", func(t *testing.T) {
		var r struct {
			Data []struct {
				Index     int    `json:"index"`
				Embedding string `json:"embedding"`
			} `json:"data"`
			Usage struct {
				PromptTokens int `json:"prompt_tokens"`
			} `json:"usage"`
		}
		b := postOK(t, ts.client, ts.srv.URL+"/v1/embeddings", `{"input":["hello world","abc"],"encoding_format":"base64"}`)
		if err := json.Unmarshal(b, &r); err != nil || len(r.Data) != 2 || r.Data[1].Index != 1 || r.Usage.PromptTokens != len(hello)+1 {
			t.Fatalf("answer %s (%v)", b, err)
		}
		raw, err := base64.StdEncoding.DecodeString(r.Data[0].Embedding)
		if err != nil || len(raw) != 16*4 {
			t.Fatalf("base64 embedding %q: %v", r.Data[0].Embedding, err)
		}
		want := embedding(t, `{"input":"hello world"}`)
		if got := math.Float32frombits(binary.LittleEndian.Uint32(raw)); got != float32(want[0]) {
			t.Errorf("base64 float %v, want %v", got, float32(want[0]))
		}
	})
	for _, path := range []string{"/v1/score", "/score"} {
		t.Run("score on "+path, func(t *testing.T) {
			b := postOK(t, ts.client, ts.srv.URL+path, `{"model":"sim","text_1":"hello world","text_2":["hello world","something else"]}`)
			var r struct {
				Object string `json:"object"`
				Data   []struct {
					Index  int     `json:"index"`
					Object string  `json:"object"`
					Score  float64 `json:"score"`
				} `json:"data"`
			}
			if err := json.Unmarshal(b, &r); err != nil || r.Object != "list" || len(r.Data) != 2 || r.Data[0].Object != "score" {
				t.Fatalf("answer %s (%v)", b, err)
			}
			if math.Abs(r.Data[0].Score-1) > 1e-9 || r.Data[1].Score < 0 || r.Data[1].Score >= 1 {
				t.Errorf("scores %+v: want 1 for the same text, [0,1) for another", r.Data)
			}
		})
	}
	for _, path := range []string{"/v1/rerank", "/rerank", "/v2/rerank"} {
		t.Run("rerank on "+path, func(t *testing.T) {
			b := postOK(t, ts.client, ts.srv.URL+path, `{"query":"red fox","documents":["blue whale","red fox","green frog"],"top_n":2}`)
			var r struct {
				ID      string `json:"id"`
				Model   string `json:"model"`
				Results []struct {
					Index    int `json:"index"`
					Document struct {
						Text string `json:"text"`
					} `json:"document"`
					RelevanceScore float64 `json:"relevance_score"`
				} `json:"results"`
				Usage struct {
					TotalTokens int `json:"total_tokens"`
				} `json:"usage"`
			}
			if err := json.Unmarshal(b, &r); err != nil || len(r.Results) != 2 || r.Model != "sim" || r.Usage.TotalTokens == 0 {
				t.Fatalf("answer %s (%v)", b, err)
			}
			if r.Results[0].Index != 1 || r.Results[0].Document.Text != "red fox" || r.Results[0].RelevanceScore < r.Results[1].RelevanceScore {
				t.Errorf("results %+v: want the query's own text first, by score", r.Results)
			}
		})
	}
	t.Run("pooling", func(t *testing.T) {
		b := postOK(t, ts.client, ts.srv.URL+"/pooling", `{"input":"hello world"}`)
		var r struct {
			Data []struct {
				Object string    `json:"object"`
				Data   []float64 `json:"data"`
			} `json:"data"`
		}
		if err := json.Unmarshal(b, &r); err != nil || len(r.Data) != 1 || r.Data[0].Object != "pooling" || len(r.Data[0].Data) != 16 {
			t.Fatalf("answer %s (%v)", b, err)
		}
	})
	t.Run("detokenize gives back what tokenize gave", func(t *testing.T) {
		text := "the quick brown fox, again"
		var tok struct {
			Tokens []uint32 `json:"tokens"`
		}
		_ = json.Unmarshal(postOK(t, ts.client, ts.srv.URL+"/tokenize", `{"prompt":"`+text+`"}`), &tok)
		ids, _ := json.Marshal(tok.Tokens)
		var r struct {
			Prompt string `json:"prompt"`
		}
		if b := postOK(t, ts.client, ts.srv.URL+"/detokenize", `{"tokens":`+string(ids)+`}`); json.Unmarshal(b, &r) != nil || r.Prompt != text {
			t.Errorf("detokenize answered %s, want %q", b, text)
		}
	})
	t.Run("transcriptions", func(t *testing.T) {
		body, ctype := multipartBody(t, 64000, map[string]string{"model": "sim"})
		resp, err := ts.client.Post(ts.srv.URL+"/v1/audio/transcriptions", ctype, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		var r struct {
			Text  string `json:"text"`
			Usage struct {
				Type    string `json:"type"`
				Seconds int    `json:"seconds"`
			} `json:"usage"`
		}
		b := readAll(t, resp)
		if json.Unmarshal(b, &r) != nil || !strings.Contains(r.Text, "64000 bytes") || r.Usage.Type != "duration" || r.Usage.Seconds != 2 {
			t.Errorf("transcription %d %s", resp.StatusCode, b)
		}
		body, ctype = multipartBody(t, 10, map[string]string{"response_format": "text"})
		resp, err = ts.client.Post(ts.srv.URL+"/v1/audio/transcriptions", ctype, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if b := readAll(t, resp); !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain") || !strings.HasPrefix(string(b), "sim transcription of 10 bytes") {
			t.Errorf("text transcription %s %q", resp.Header.Get("Content-Type"), b)
		}
	})
	if s := ts.kv(t); s.PoolingRequestsTotal != 15 || s.PoolingAbortedTotal != 0 {
		t.Errorf("pooling_requests_total %d, pooling_aborted_total %d; want 15 and 0", s.PoolingRequestsTotal, s.PoolingAbortedTotal)
	}
}

func TestAClientLeavingAPoolingRequestStopsItAndIsCounted(t *testing.T) {
	cfg := fastConfig()
	cfg.PrefillTime = time.Hour // never done: only the client's leaving ends it
	ts := startServer(t, cfg)
	audio, ctype := multipartBody(t, 100, nil)
	for i, tc := range []struct{ path, body, ctype string }{
		{"/v1/embeddings", `{"input":"slow"}`, "application/json"},
		{"/v1/rerank", `{"query":"q","documents":["a"]}`, "application/json"},
		{"/v1/audio/transcriptions", audio, ctype},
	} {
		t.Run(tc.path, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, ts.srv.URL+tc.path, strings.NewReader(tc.body))
			req.Header.Set("Content-Type", tc.ctype)
			done := make(chan error, 1)
			go func() {
				resp, err := ts.client.Do(req)
				if err == nil {
					resp.Body.Close()
					err = fmt.Errorf("answered %d", resp.StatusCode)
				}
				done <- err
			}()
			ts.waitKV(t, "the engine took the request", func(s KVStats) bool { return s.PoolingRequestsTotal == i+1 })
			cancel()
			if err := <-done; ctx.Err() == nil {
				t.Fatalf("the request ended by itself: %v", err)
			}
			ts.waitKV(t, "the engine saw the client leave", func(s KVStats) bool { return s.PoolingAbortedTotal == i+1 })
		})
	}
	if m := string(ts.get(t, "/metrics")); !strings.Contains(m, `pdproxy_sim_pooling_aborted_total{model_name="sim"} 3`) ||
		!strings.Contains(m, `pdproxy_sim_pooling_requests_total{model_name="sim"} 3`) {
		t.Errorf("/metrics lacks the pooling counters:\n%s", m)
	}
}
