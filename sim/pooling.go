package sim

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"mime"
	"mime/multipart"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
)

// vLLM's pooling-style routes, with deterministic answers in vLLM's shapes:
// POST /v1/embeddings, /pooling, /v1/score and /score, /v1/rerank, /rerank
// and /v2/rerank, /detokenize and /v1/audio/transcriptions. Each one is a
// job outside the KV scheduler that costs PrefillTime plus PrefillPerToken
// per input token (an audio file: per KiB) on the engine's clock, the
// X-Sim-Stall fault on top, and a client that closes its connection before
// the answer stops it, as vLLM aborts a request whose client left. Jobs
// whose body and model were valid count in pooling_requests_total, those
// stopped so in pooling_aborted_total (/debug/kv; pdproxy_sim_* on /metrics).
//
// An embedding is a unit vector of EmbeddingDim (--embedding-dim) floats
// from a hash of the input's tokens; a score is the cosine of two inputs'
// embeddings mapped to [0, 1], so that a text scores 1 against itself.

// poolJob is one parsed pooling request: what it is for, what it costs,
// and its answer.
type poolJob struct {
	model    string
	priority int
	tokens   int // the cost: input tokens (an audio file: KiB)
	// answer builds the JSON answer, or (text) a text/plain one.
	answer func(id, model string) any
}

// plainText is an answer sent as text/plain.
type plainText string

// poolUsage is vLLM's UsageInfo of a pooling answer.
type poolUsage struct {
	PromptTokens        int  `json:"prompt_tokens"`
	TotalTokens         int  `json:"total_tokens"`
	CompletionTokens    int  `json:"completion_tokens"`
	PromptTokensDetails *int `json:"prompt_tokens_details"`
}

func usageOf(tokens int) poolUsage { return poolUsage{PromptTokens: tokens, TotalTokens: tokens} }

// poolParser reads one route's body; r gives the headers (multipart).
type poolParser func(e *Engine, r *http.Request, body []byte) (*poolJob, error)

// pooling serves one pooling route: read, validate, wait the job's cost
// unless the client leaves, answer.
func (e *Engine) pooling(prefix string, parse poolParser) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		rid := r.Header.Get("X-Request-Id")
		if rid == "" {
			rid = newRequestID()
		}
		w.Header().Set("X-Request-Id", rid)
		f, err := e.faults(r.Header)
		if err != nil {
			writeError(w, err)
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
		if f.failStatus != 0 {
			writeError(w, statusError(f.failStatus, "injected_fault", "injected failure (status %d)", f.failStatus))
			return
		}
		if err != nil {
			writeError(w, bodyReadError(err))
			return
		}
		job, err := parse(e, r, body)
		if err == nil {
			job.model, err = e.resolveModel(job.model)
		}
		if err == nil {
			err = e.checkPriority(job.priority)
		}
		if err != nil {
			writeError(w, err)
			return
		}
		e.mu.Lock()
		e.counts.pooling++
		e.counts.priorities[job.priority]++
		e.mu.Unlock()
		cost := e.cfg.PrefillTime + time.Duration(job.tokens)*e.cfg.PrefillPerToken + f.stall
		// The whole body was read, so net/http watches the connection and
		// cancels the context when the client closes it.
		if err := sleep(r.Context(), e.clock, cost); err != nil {
			e.mu.Lock()
			e.counts.poolingAborted++
			e.mu.Unlock()
			if ce := e.log.Check(zap.DebugLevel, "client gone, pooling request aborted"); ce != nil {
				ce.Write(zap.String("request_id", rid), zap.String("path", r.URL.Path))
			}
			return
		}
		v := job.answer(prefix+"-"+rid, job.model)
		if t, ok := v.(plainText); ok {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			_, _ = io.WriteString(w, string(t))
			return
		}
		writeJSON(w, http.StatusOK, v)
	}
}

// poolHead is the fields every pooling body may carry.
type poolHead struct {
	Model    *string `json:"model"`
	Priority *int    `json:"priority"`
}

func (h poolHead) job(tokens int) *poolJob {
	j := &poolJob{tokens: tokens}
	if h.Model != nil {
		j.model = *h.Model
	}
	if h.Priority != nil {
		j.priority = *h.Priority
	}
	return j
}

// decodeStrict decodes one JSON object, nothing after it.
func decodeStrict(body []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(v); err != nil {
		return badRequest("invalid_json", "request body is not a valid JSON object: %v", err)
	}
	if dec.More() {
		return badRequest("invalid_json", "request body has trailing data after the JSON object")
	}
	return nil
}

// poolInputs tokenizes an embeddings or pooling input: a string, a list
// of strings, a list of token ids or a list of such lists.
func (e *Engine) poolInputs(raw json.RawMessage) ([][]uint32, int, error) {
	in, err := completionPrompts(e.tok, raw)
	if err != nil {
		return nil, 0, badRequest("invalid_input", "input must be a string, a list of strings, a list of token ids or a list of token id lists, not empty")
	}
	n := 0
	for _, t := range in {
		if e.cfg.MaxModelLen > 0 && len(t) > e.cfg.MaxModelLen {
			return nil, 0, badRequest("input_too_long", "This model's maximum context length is %d tokens. However, you requested %d tokens in the input for embedding generation. Please reduce the length of the input.", e.cfg.MaxModelLen, len(t))
		}
		n += len(t)
	}
	return in, n, nil
}

// embed is the unit vector of dim floats for tokens.
func embed(tokens []uint32, dim int) []float64 {
	h := fnv.New64a()
	var b [4]byte
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b[:], t)
		_, _ = h.Write(b[:])
	}
	seed := h.Sum64()
	v := make([]float64, dim)
	norm := 0.0
	for j := range v {
		v[j] = float64(int64(mix64(seed^uint64(j+1)*0x9e3779b97f4a7c15))) / math.MaxInt64
		norm += v[j] * v[j]
	}
	norm = math.Sqrt(norm)
	for j := range v {
		v[j] /= norm
	}
	return v
}

// similarity is the cosine of a's and b's embeddings, mapped to [0, 1].
func (e *Engine) similarity(a, b []uint32) float64 {
	x, y := embed(a, e.cfg.EmbeddingDim), embed(b, e.cfg.EmbeddingDim)
	dot := 0.0
	for i := range x {
		dot += x[i] * y[i]
	}
	return math.Max(0, math.Min(1, (dot+1)/2))
}

func parseEmbeddings(e *Engine, _ *http.Request, body []byte) (*poolJob, error) {
	var req struct {
		poolHead
		Input          json.RawMessage `json:"input"`
		EncodingFormat *string         `json:"encoding_format"`
		Dimensions     *int            `json:"dimensions"`
	}
	if err := decodeStrict(body, &req); err != nil {
		return nil, err
	}
	in, n, err := e.poolInputs(req.Input)
	if err != nil {
		return nil, err
	}
	dim := e.cfg.EmbeddingDim
	if req.Dimensions != nil {
		if *req.Dimensions < 1 || *req.Dimensions > dim {
			return nil, badRequest("invalid_dimensions", "dimensions=%d: must be between 1 and %d", *req.Dimensions, dim)
		}
		dim = *req.Dimensions
	}
	b64 := false
	if req.EncodingFormat != nil {
		switch *req.EncodingFormat {
		case "float":
		case "base64":
			b64 = true
		default:
			return nil, badRequest("invalid_encoding_format", "encoding_format %q: want float or base64", *req.EncodingFormat)
		}
	}
	j := req.job(n)
	j.answer = func(id, model string) any {
		type item struct {
			Object    string `json:"object"`
			Index     int    `json:"index"`
			Embedding any    `json:"embedding"`
		}
		data := make([]item, len(in))
		for i, t := range in {
			// The first dim components, renormalized (matryoshka style).
			v := embed(t, e.cfg.EmbeddingDim)[:dim]
			norm := 0.0
			for _, x := range v {
				norm += x * x
			}
			for k := range v {
				v[k] /= math.Sqrt(norm)
			}
			data[i] = item{Object: "embedding", Index: i, Embedding: v}
			if b64 {
				// vLLM's base64: the float32 values, little-endian.
				buf := make([]byte, 4*len(v))
				for k, x := range v {
					binary.LittleEndian.PutUint32(buf[4*k:], math.Float32bits(float32(x)))
				}
				data[i].Embedding = base64.StdEncoding.EncodeToString(buf)
			}
		}
		return poolList[item]{id, "list", e.clock.Now().Unix(), model, data, usageOf(n)}
	}
	return j, nil
}

// poolList is the list answer of embeddings, pooling and score, around their items.
type poolList[T any] struct {
	ID      string    `json:"id"`
	Object  string    `json:"object"`
	Created int64     `json:"created"`
	Model   string    `json:"model"`
	Data    []T       `json:"data"`
	Usage   poolUsage `json:"usage"`
}

func parsePooling(e *Engine, _ *http.Request, body []byte) (*poolJob, error) {
	var req struct {
		poolHead
		Input json.RawMessage `json:"input"`
	}
	if err := decodeStrict(body, &req); err != nil {
		return nil, err
	}
	in, n, err := e.poolInputs(req.Input)
	if err != nil {
		return nil, err
	}
	j := req.job(n)
	j.answer = func(id, model string) any {
		type item struct {
			Index  int       `json:"index"`
			Object string    `json:"object"`
			Data   []float64 `json:"data"`
		}
		data := make([]item, len(in))
		for i, t := range in {
			data[i] = item{Index: i, Object: "pooling", Data: embed(t, e.cfg.EmbeddingDim)}
		}
		return poolList[item]{id, "list", e.clock.Now().Unix(), model, data, usageOf(n)}
	}
	return j, nil
}

// texts reads a string or a non-empty list of strings.
func texts(raw json.RawMessage, field string) ([]string, error) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return []string{s}, nil
	}
	var ss []string
	if json.Unmarshal(raw, &ss) == nil && len(ss) > 0 {
		return ss, nil
	}
	return nil, badRequest("invalid_"+field, "%s must be a string or a non-empty list of strings", field)
}

func parseScore(e *Engine, _ *http.Request, body []byte) (*poolJob, error) {
	var req struct {
		poolHead
		Text1 json.RawMessage `json:"text_1"`
		Text2 json.RawMessage `json:"text_2"`
	}
	if err := decodeStrict(body, &req); err != nil {
		return nil, err
	}
	t1, err := texts(req.Text1, "text_1")
	if err != nil {
		return nil, err
	}
	t2, err := texts(req.Text2, "text_2")
	if err != nil {
		return nil, err
	}
	if len(t1) != 1 && len(t1) != len(t2) {
		return nil, badRequest("invalid_text_1", "text_1 has %d texts and text_2 %d: want one text_1, or as many as text_2", len(t1), len(t2))
	}
	n := 0
	pairs := make([][2][]uint32, len(t2))
	for i := range t2 {
		a := t1[0]
		if len(t1) > 1 {
			a = t1[i]
		}
		pairs[i] = [2][]uint32{promptTokens(a), promptTokens(t2[i])}
		n += len(pairs[i][0]) + len(pairs[i][1])
	}
	j := req.job(n)
	j.answer = func(id, model string) any {
		type item struct {
			Index  int     `json:"index"`
			Object string  `json:"object"`
			Score  float64 `json:"score"`
		}
		data := make([]item, len(pairs))
		for i, p := range pairs {
			data[i] = item{Index: i, Object: "score", Score: e.similarity(p[0], p[1])}
		}
		return poolList[item]{id, "list", e.clock.Now().Unix(), model, data, usageOf(n)}
	}
	return j, nil
}

func parseRerank(e *Engine, _ *http.Request, body []byte) (*poolJob, error) {
	var req struct {
		poolHead
		Query     *string           `json:"query"`
		Documents []json.RawMessage `json:"documents"`
		TopN      *int              `json:"top_n"`
	}
	if err := decodeStrict(body, &req); err != nil {
		return nil, err
	}
	if req.Query == nil {
		return nil, badRequest("missing_query", "query is required")
	}
	if len(req.Documents) == 0 {
		return nil, badRequest("missing_documents", "documents is required and must not be empty")
	}
	docs := make([]string, len(req.Documents))
	for i, raw := range req.Documents {
		var d struct {
			Text *string `json:"text"`
		}
		if json.Unmarshal(raw, &docs[i]) != nil && (json.Unmarshal(raw, &d) != nil || d.Text == nil) {
			return nil, badRequest("invalid_documents", "documents[%d]: want a string or {\"text\": ...}", i)
		}
		if d.Text != nil {
			docs[i] = *d.Text
		}
	}
	topN := len(docs)
	if req.TopN != nil && *req.TopN > 0 {
		topN = min(*req.TopN, len(docs))
	} else if req.TopN != nil && *req.TopN < 0 {
		return nil, badRequest("invalid_top_n", "top_n=%d: must not be negative", *req.TopN)
	}
	q := promptTokens(*req.Query)
	n := 0
	dt := make([][]uint32, len(docs))
	for i, d := range docs {
		dt[i] = promptTokens(d)
		n += len(q) + len(dt[i])
	}
	j := req.job(n)
	j.answer = func(id, model string) any {
		type result struct {
			Index    int `json:"index"`
			Document struct {
				Text string `json:"text"`
			} `json:"document"`
			RelevanceScore float64 `json:"relevance_score"`
		}
		results := make([]result, len(docs))
		for i := range docs {
			results[i].Index = i
			results[i].Document.Text = docs[i]
			results[i].RelevanceScore = e.similarity(q, dt[i])
		}
		slices.SortStableFunc(results, func(a, b result) int {
			switch {
			case a.RelevanceScore > b.RelevanceScore:
				return -1
			case a.RelevanceScore < b.RelevanceScore:
				return 1
			}
			return 0
		})
		return struct {
			ID    string `json:"id"`
			Model string `json:"model"`
			Usage struct {
				TotalTokens int `json:"total_tokens"`
			} `json:"usage"`
			Results []result `json:"results"`
		}{ID: id, Model: model, Usage: struct {
			TotalTokens int `json:"total_tokens"`
		}{n}, Results: results[:topN]}
	}
	return j, nil
}

func parseDetokenize(e *Engine, _ *http.Request, body []byte) (*poolJob, error) {
	var req struct {
		poolHead
		Tokens *[]int64 `json:"tokens"`
	}
	if err := decodeStrict(body, &req); err != nil {
		return nil, err
	}
	if req.Tokens == nil {
		return nil, badRequest("missing_tokens", "tokens is required")
	}
	for i, t := range *req.Tokens {
		if t < 0 || t >= vocabSize {
			return nil, badRequest("invalid_tokens", "tokens[%d]: token id %d is out of vocabulary [0, %d)", i, t, vocabSize)
		}
	}
	j := req.job(len(*req.Tokens))
	j.answer = func(string, string) any {
		return struct {
			Prompt string `json:"prompt"`
		}{e.vocab.text(*req.Tokens)}
	}
	return j, nil
}

// audioBytesPerSecond is 16 kHz 16-bit mono PCM's: how long the sim takes a file to last.
const audioBytesPerSecond = 32000

func parseTranscription(e *Engine, r *http.Request, body []byte) (*poolJob, error) {
	mt, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "multipart/form-data" || params["boundary"] == "" {
		return nil, badRequest("invalid_content_type", "a transcription is multipart/form-data with a file")
	}
	form, err := multipart.NewReader(bytes.NewReader(body), params["boundary"]).ReadForm(maxBodyBytes)
	if err != nil {
		return nil, badRequest("invalid_form", "read multipart form: %v", err)
	}
	defer func() { _ = form.RemoveAll() }()
	files := form.File["file"]
	if len(files) != 1 {
		return nil, badRequest("missing_file", "file is required, once")
	}
	fh, err := files[0].Open()
	if err != nil {
		return nil, badRequest("invalid_file", "open file: %v", err)
	}
	audio, err := io.ReadAll(fh)
	_ = fh.Close()
	if err != nil {
		return nil, badRequest("invalid_file", "read file: %v", err)
	}
	var head poolHead
	if v := form.Value["model"]; len(v) > 0 {
		head.Model = &v[0]
	}
	if v := form.Value["priority"]; len(v) > 0 {
		p, err := strconv.Atoi(v[0])
		if err != nil {
			return nil, badRequest("invalid_priority", "priority %q: not an integer", v[0])
		}
		head.Priority = &p
	}
	format := "json"
	if v := form.Value["response_format"]; len(v) > 0 {
		format = v[0]
	}
	if format != "json" && format != "text" {
		return nil, badRequest("invalid_response_format", "response_format %q: the sim answers json or text", format)
	}
	h := fnv.New64a()
	_, _ = h.Write(audio)
	text := fmt.Sprintf("sim transcription of %d bytes %016x", len(audio), h.Sum64())
	seconds := (len(audio) + audioBytesPerSecond - 1) / audioBytesPerSecond
	j := head.job((len(audio) + 1023) / 1024)
	j.answer = func(string, string) any {
		if format == "text" {
			return plainText(text)
		}
		type durationUsage struct {
			Type    string `json:"type"`
			Seconds int    `json:"seconds"`
		}
		return struct {
			Text  string        `json:"text"`
			Usage durationUsage `json:"usage"`
		}{text, durationUsage{"duration", seconds}}
	}
	return j, nil
}

// vocabulary maps the token ids this engine's POST /tokenize gave back to
// their text, for /detokenize: the sim's ids are hashes, so only text the
// engine has seen can be given back. It holds at most maxVocabulary
// pieces, the first ones seen; an id it lacks reads back as <|id|>.
type vocabulary struct {
	mu     sync.Mutex
	pieces map[uint32]string
}

const maxVocabulary = 1 << 16

func newVocabulary() *vocabulary {
	return &vocabulary{pieces: map[uint32]string{tokenBOS: "", tokenIMStart: "<|im_start|>", tokenIMEnd: "<|im_end|>"}}
}

// learn records the pieces of each text.
func (v *vocabulary) learn(texts ...string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, s := range texts {
		forEachPiece(s, func(p string) {
			if len(v.pieces) < maxVocabulary {
				v.pieces[pieceID(p)] = p
			}
		})
	}
}

// text is the text of ids: their pieces joined.
func (v *vocabulary) text(ids []int64) string {
	v.mu.Lock()
	defer v.mu.Unlock()
	var b strings.Builder
	for _, id := range ids {
		if p, ok := v.pieces[uint32(id)]; ok {
			b.WriteString(p)
			continue
		}
		fmt.Fprintf(&b, "<|%d|>", id)
	}
	return b.String()
}
