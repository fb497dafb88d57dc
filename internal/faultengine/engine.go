// Package faultengine is an inference engine for tests that misbehaves on purpose, byte by
// byte: a raw TCP server that reads HTTP/1.1 requests and answers each as a script says,
// down to a status line followed by a reset, a stream that goes silent, or a connection
// closed with the request unread. It speaks enough of vLLM's (prefill then decode, with
// kv_transfer_params) and SGLang's (paired legs, /server_info, /abort_request) protocols that
// a proxy in front of it runs its real flow, and records what each request carried, so that a
// test can check what reached which engine.
package faultengine

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Fault is how an engine misbehaves on the requests a script gives it to.
type Fault string

// The faults. Each names what the engine does instead of its normal answer.
const (
	None Fault = ""
	// Status500, Status503: an error answer in the OpenAI shape, from a front that neither
	// acknowledges nor reads the request.
	Status500 Fault = "status_500"
	Status503 Fault = "status_503"
	// Status400: the engine's handler refuses the request as bad, in vLLM's error shape.
	Status400 Fault = "status_400"
	// Status400Huge: a 400 whose JSON body is 100 KiB.
	Status400Huge Fault = "status_400_huge"
	// Status422Empty: a 422 with no body and no content type.
	Status422Empty Fault = "status_422_empty"
	// CloseAfterRead: reads the whole request, then closes the connection without a byte.
	CloseAfterRead Fault = "close_after_read"
	// Silent: reads the request and never answers.
	Silent Fault = "silent"
	// HeadersThenClose, HeadersThenReset, HeadersThenSilence: the 200's head, then the
	// connection closes, is reset, or goes silent.
	HeadersThenClose   Fault = "headers_then_close"
	HeadersThenReset   Fault = "headers_then_reset"
	HeadersThenSilence Fault = "headers_then_silence"
	// MidClose, MidReset, MidSilence: part of the answer (half its events, for a stream),
	// then the same.
	MidClose   Fault = "mid_close"
	MidReset   Fault = "mid_reset"
	MidSilence Fault = "mid_silence"
	// EmptyClose: a 200 with neither length nor chunking, closed at once.
	EmptyClose Fault = "empty_close"
	// NoDone: a stream that ends cleanly without its [DONE] (a JSON answer is whole).
	NoDone Fault = "no_done"
	// BigHeaders: a normal answer whose head carries 150 extra header lines and one of
	// 5 KiB, past the 8 KiB a proxy buffer for a response head often holds.
	BigHeaders Fault = "big_headers"
	// KeepAliveReset: answers normally, then resets the kept-open connection as the next
	// request arrives, before reading it (the keep-alive race); that request is not read.
	KeepAliveReset Fault = "keepalive_reset"
	// BadParams: a prefill answer whose kv_transfer_params is not an object.
	BadParams Fault = "bad_params"
	// LateEnd: a whole answer whose end (HTTP/1.1's last chunk) comes LateEndDelay after
	// the rest.
	LateEnd Fault = "late_end"

	// The faults only a stream has; any other answer is whole and unfaulted.

	// ShortStream: half a stream's events, then its clean end (HTTP/1.1's last chunk), with
	// neither a finish_reason nor [DONE]: an engine that stops generating without saying why.
	ShortStream Fault = "short_stream"
	// MidError: half of a completions or chat stream's events, then an error event in
	// vLLM's shape and the [DONE] after it, as vLLM ends a stream whose generation raised.
	MidError Fault = "mid_error"
)

// LateEndDelay is how long LateEnd holds back an answer's end.
const LateEndDelay = 300 * time.Millisecond

// Faults lists every fault, for tables.
func Faults() []Fault {
	return []Fault{Status500, Status503, Status400, Status400Huge, Status422Empty, CloseAfterRead, Silent,
		HeadersThenClose, HeadersThenReset, HeadersThenSilence, MidClose, MidReset, MidSilence, EmptyClose, NoDone,
		BigHeaders, KeepAliveReset, BadParams, LateEnd}
}

// StreamFaults lists the faults only a stream has (ShortStream, MidError), for tables.
func StreamFaults() []Fault { return []Fault{ShortStream, MidError} }

// Protocol is what the engine speaks.
type Protocol string

// Protocols.
const (
	VLLM   Protocol = "vllm"
	SGLang Protocol = "sglang"
	// Mooncake is vLLM's MooncakeConnector: legs at once under a transfer id, the
	// prefiller's bootstrap /query served on the engine's own port.
	Mooncake Protocol = "mooncake"
)

// Config is one engine.
type Config struct {
	Protocol Protocol
	// Prefill: the engine is a prefiller (vLLM: it answers with kv_transfer_params; SGLang:
	// it serves /server_info and its leg's answer is dropped).
	Prefill bool
	// Fault applies to generation requests (completions, chat) and embeddings; None for a
	// healthy engine.
	Fault Fault
	// Chunks is how many token events a stream has (default 4): tokens t0, t1, ... whose ids
	// are 1000, 1001, ..., the last with a finish_reason ("length" when max_tokens ends it
	// first). With return_token_ids, each chunk's choice carries its id in token_ids and the
	// first chunk the prompt's ids in prompt_token_ids (a completion's on its choice, a
	// chat's at the top), as vLLM reports them. A completions prompt of ids takes up the
	// answer where the ids of its tokens (those from 1000 on) leave it, so that a stream cut
	// after t1 and continued from its prompt and t0, t1 goes on with t2.
	Chunks int
	// Rooms pairs SGLang legs: the prefiller marks its room transferred as it answers, and a
	// decoder starts its answer only then, as SGLang's decoder waits for the room's KV.
	Rooms *Rooms
	// OnFault, when set, is called each time the engine performs its fault, before any byte
	// of it reaches the peer (the error answer, the oversized head, the withheld end, the
	// reset), and the engine goes on only once it returns: a test can act on the fault's
	// moment (a client that leaves as it strikes) knowing that nothing of the fault was seen
	// yet. It must return, and is called from the connection's goroutine.
	OnFault func(Fault)
	// OnGenerate, when set, is called with each generation request the engine read whole,
	// before any byte of its answer (and before its fault), and the engine goes on only once
	// it returns: a test can act at the moment a given request arrives. The same rules as
	// OnFault's.
	OnGenerate func(Request)
}

// Rooms are SGLang bootstrap rooms shared by a prefiller and a decoder.
type Rooms struct {
	mu sync.Mutex
	m  map[string]chan struct{}
}

// NewRooms returns an empty set of rooms.
func NewRooms() *Rooms { return &Rooms{m: map[string]chan struct{}{}} }

func (r *Rooms) ch(room string) chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	c, ok := r.m[room]
	if !ok {
		c = make(chan struct{})
		r.m[room] = c
	}
	return c
}

func (r *Rooms) transferred(room string) {
	c := r.ch(room)
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case <-c:
	default:
		close(c)
	}
}

// Request is a request the engine read whole.
type Request struct {
	Path   string
	Header http.Header
	Body   []byte
	At     time.Time
}

// Field returns the raw JSON of a top-level body field, nil when absent.
func (r Request) Field(name string) json.RawMessage { return rawField(r.Body, name) }

// Engine is a running fault engine.
type Engine struct {
	cfg  Config
	ln   net.Listener
	wg   sync.WaitGroup
	stop chan struct{}

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	reqs   []Request
	faulty chan struct{} // closed when the first faulty generation request arrives
	once   sync.Once
}

// Start runs an engine on a loopback port.
func Start(cfg Config) (*Engine, error) {
	if cfg.Chunks == 0 {
		cfg.Chunks = 4
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	e := &Engine{cfg: cfg, ln: ln, stop: make(chan struct{}), conns: map[net.Conn]struct{}{}, faulty: make(chan struct{})}
	e.wg.Add(1)
	go e.accept()
	return e, nil
}

// URL is the engine's base URL.
func (e *Engine) URL() string { return "http://" + e.ln.Addr().String() }

// Faulted is closed once the engine performed its fault (see Config.OnFault).
func (e *Engine) Faulted() <-chan struct{} { return e.faulty }

// Requests are the requests the engine read whole, in order.
func (e *Engine) Requests() []Request {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]Request(nil), e.reqs...)
}

// Close stops the engine and cuts its connections, silent ones too.
func (e *Engine) Close() {
	close(e.stop)
	e.ln.Close()
	e.mu.Lock()
	for c := range e.conns {
		c.Close()
	}
	e.mu.Unlock()
	e.wg.Wait()
}

func (e *Engine) accept() {
	defer e.wg.Done()
	for {
		c, err := e.ln.Accept()
		if err != nil {
			return
		}
		e.mu.Lock()
		e.conns[c] = struct{}{}
		e.mu.Unlock()
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			defer func() {
				e.mu.Lock()
				delete(e.conns, c)
				e.mu.Unlock()
				c.Close()
			}()
			e.serve(c)
		}()
	}
}

// serve answers the requests of one connection until it closes or a fault ends it.
func (e *Engine) serve(c net.Conn) {
	br := bufio.NewReader(c)
	for n := 0; ; n++ {
		if n > 0 && e.cfg.Fault == KeepAliveReset {
			// The next request arrives; the engine resets the connection before reading it.
			if _, err := br.Peek(1); err != nil {
				return
			}
			e.fault(KeepAliveReset)
			reset(c)
			return
		}
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		// An engine that refuses a generation request unread (its front, before the
		// handler) neither acknowledges nor reads it; any other handler acknowledges the
		// body as it starts to read it, as Go's server and uvicorn do.
		unread := e.cfg.Fault == Status500 || e.cfg.Fault == Status503
		if !isGeneration(req.URL.Path) {
			unread = false
		}
		if strings.EqualFold(req.Header.Get("Expect"), "100-continue") && !unread {
			if !writeRaw(c, "HTTP/1.1 100 Continue\r\n\r\n") {
				return
			}
		}
		body, err := io.ReadAll(req.Body)
		if err != nil {
			return
		}
		if !unread {
			r := Request{Path: req.URL.Path, Header: req.Header, Body: body, At: time.Now()}
			e.mu.Lock()
			e.reqs = append(e.reqs, r)
			e.mu.Unlock()
			if e.cfg.OnGenerate != nil && isGeneration(req.URL.Path) {
				e.cfg.OnGenerate(r)
			}
		}
		if !e.answer(c, req, body) {
			return
		}
	}
}

// fault signals that the engine performs f, before it does.
func (e *Engine) fault(f Fault) {
	e.once.Do(func() { close(e.faulty) })
	if e.cfg.OnFault != nil {
		e.cfg.OnFault(f)
	}
}

// isGeneration reports whether path is one a model answers: a completion, a Responses API
// or Messages API request, a token-in generate request, or an embedding (a route the proxy
// passes to one engine without P/D).
func isGeneration(path string) bool {
	return strings.HasSuffix(path, "/completions") || path == "/v1/responses" || path == "/v1/messages" || path == "/v1/embeddings" ||
		path == GenerateRoute
}

// GenerateRoute is vLLM's token-in route: token_ids in, token ids out, max_tokens inside
// sampling_params.
const GenerateRoute = "/inference/v1/generate"

// reset closes c with a reset rather than a clean close.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	c.Close()
}

// hang waits until the engine stops or the peer closes c.
func (e *Engine) hang(c net.Conn) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		io.Copy(io.Discard, c)
	}()
	select {
	case <-e.stop:
	case <-done:
	}
}

// answer writes the answer to req; false ends the connection.
func (e *Engine) answer(c net.Conn, req *http.Request, body []byte) bool {
	switch req.URL.Path {
	case "/server_info", "/get_server_info":
		return writeJSON(c, 200, `{"disaggregation_mode":"prefill","disaggregation_bootstrap_port":8998}`)
	case "/query":
		return writeJSON(c, 200, `{"0":{"engine_id":"fault-prefill-0"}}`)
	case "/abort_request":
		return writeRaw(c, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
	case "/health", "/v1/models", "/metrics":
		return writeJSON(c, 200, `{"object":"list","data":[{"id":"m","object":"model"}]}`)
	}
	chat := strings.HasSuffix(req.URL.Path, "/chat/completions")
	responses := req.URL.Path == "/v1/responses"
	messages := req.URL.Path == "/v1/messages"
	generate := req.URL.Path == GenerateRoute
	var f struct {
		Stream         bool `json:"stream"`
		ReturnTokenIDs bool `json:"return_token_ids"`
	}
	json.Unmarshal(body, &f)
	prefill := e.cfg.Prefill
	fault := e.cfg.Fault
	if fault == KeepAliveReset {
		fault = None // its fault is on the connection, before the next request
	}
	if fault == BadParams && !(prefill && e.cfg.Protocol == VLLM) {
		fault = None // only a vLLM prefiller answers with params
	}
	if (fault == ShortStream || fault == MidError) && (prefill || !f.Stream) || fault == MidError && (responses || messages) {
		fault = None // a stream's faults, and vLLM's error event is a completion's or a chat's
	}
	if fault != None && fault != LateEnd {
		e.fault(fault) // LateEnd's is at the end it withholds
	}
	id := req.Header.Get("X-Request-Id")
	var payload []string
	contentType := "application/json"
	switch {
	case prefill && e.cfg.Protocol == VLLM:
		params := fmt.Sprintf(`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3]],"remote_engine_id":"fault","remote_request_id":%q,"remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}`, id)
		if fault == BadParams {
			params = `"not an object"`
		}
		payload = []string{fmt.Sprintf(`{"id":"cmpl-p","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],"kv_transfer_params":%s}`, params)}
		if generate {
			payload = []string{fmt.Sprintf(`{"request_id":"generate-tokens-p","choices":[{"index":0,"logprobs":null,"finish_reason":"length","token_ids":[1000]}],"prompt_logprobs":null,"kv_transfer_params":%s}`, params)}
		}
		f.Stream = false
	case f.Stream && responses:
		// The Responses API's typed events, ending with response.completed (it has no
		// [DONE]: the last event is what NoDone leaves out).
		contentType = "text/event-stream"
		payload = append(payload, "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_c\",\"object\":\"response\",\"status\":\"in_progress\",\"output\":[]}}\n\n")
		for i := range e.cfg.Chunks {
			payload = append(payload, fmt.Sprintf("event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":%d,\"item_id\":\"msg_c\",\"output_index\":0,\"content_index\":0,\"delta\":\"t%d\"}\n\n", i+1, i))
		}
		payload = append(payload, fmt.Sprintf("event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":%d,\"response\":{\"id\":\"resp_c\",\"object\":\"response\",\"status\":\"completed\",\"output\":[]}}\n\n", e.cfg.Chunks+1))
	case f.Stream && messages:
		// Anthropic's Messages events, ending with message_stop (no [DONE]: the last event
		// is what NoDone leaves out).
		contentType = "text/event-stream"
		payload = append(payload, "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_c\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"m\",\"content\":[],\"stop_reason\":null,\"usage\":{\"input_tokens\":2,\"output_tokens\":0}}}\n\n"+
			"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n")
		for i := range e.cfg.Chunks {
			payload = append(payload, fmt.Sprintf("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"t%d\"}}\n\n", i))
		}
		payload = append(payload, fmt.Sprintf("event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n"+
			"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":%d}}\n\n", e.cfg.Chunks),
			"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")
	case messages:
		payload = []string{`{"id":"msg_c","type":"message","role":"assistant","model":"m","content":[{"type":"text","text":"hello"}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":2,"output_tokens":1}}`}
	case responses:
		payload = []string{`{"id":"resp_c","object":"response","status":"completed","output":[{"type":"message","id":"msg_c","role":"assistant","status":"completed","content":[{"type":"output_text","text":"hello","annotations":[]}]}]}`}
	case f.Stream && generate:
		contentType = "text/event-stream"
		payload = e.generateEvents(body)
	case generate:
		payload = []string{`{"request_id":"generate-tokens-c","choices":[{"index":0,"logprobs":null,"finish_reason":"stop","token_ids":[1000,1001]}],"prompt_logprobs":null,"kv_transfer_params":null}`}
	case f.Stream:
		contentType = "text/event-stream"
		payload = e.tokenEvents(body, chat, f.ReturnTokenIDs)
	case req.URL.Path == "/v1/embeddings":
		payload = []string{`{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.125,-0.5,1]}],"model":"m","usage":{"prompt_tokens":2,"total_tokens":2}}`}
		f.Stream = false
	case chat:
		payload = []string{`{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}]}`}
	default:
		payload = []string{`{"id":"c","object":"text_completion","choices":[{"index":0,"text":"hello","finish_reason":"stop"}]}`}
	}

	if (e.cfg.Protocol == SGLang || e.cfg.Protocol == Mooncake) && e.cfg.Rooms != nil {
		room := string(rawField(body, "bootstrap_room"))
		if e.cfg.Protocol == Mooncake {
			room = string(rawField(rawField(body, "kv_transfer_params"), "transfer_id"))
		}
		switch {
		case prefill && sendsHead(fault):
			e.cfg.Rooms.transferred(room)
		case !prefill && !e.waitRoom(c, e.cfg.Rooms.ch(room)):
			return false
		}
	}
	head := "HTTP/1.1 200 OK\r\nContent-Type: " + contentType + "\r\nTransfer-Encoding: chunked\r\n"
	switch fault {
	case Status500, Status503, Status400:
		code := map[Fault]int{Status500: 500, Status503: 503, Status400: 400}[fault]
		return writeJSON(c, code, `{"error":{"message":"engine says no","type":"BadRequestError","code":`+strconv.Itoa(code)+`}}`)
	case Status400Huge:
		return writeJSON(c, 400, `{"error":{"message":"`+strings.Repeat("x", 100<<10)+`","type":"BadRequestError","code":400}}`)
	case Status422Empty:
		return writeRaw(c, "HTTP/1.1 422 Unprocessable Entity\r\nContent-Length: 0\r\n\r\n")
	case CloseAfterRead:
		return false
	case Silent:
		e.hang(c)
		return false
	case EmptyClose:
		writeRaw(c, "HTTP/1.1 200 OK\r\nContent-Type: "+contentType+"\r\n\r\n")
		return false
	case BigHeaders:
		var b strings.Builder
		b.WriteString("HTTP/1.1 200 OK\r\nContent-Type: " + contentType + "\r\nTransfer-Encoding: chunked\r\n")
		for i := range 150 {
			fmt.Fprintf(&b, "X-Engine-Note-%d: %d\r\n", i, i)
		}
		b.WriteString("X-Engine-Big: " + strings.Repeat("b", 5<<10) + "\r\n")
		head = b.String()
	}
	if !writeRaw(c, head+"\r\n") {
		return false
	}
	switch fault {
	case HeadersThenClose:
		return false
	case HeadersThenReset:
		reset(c)
		return false
	case HeadersThenSilence:
		e.hang(c)
		return false
	}
	full := strings.Join(payload, "")
	var parts []string
	switch {
	case len(payload) > 1:
		parts = payload
	default:
		// A JSON answer goes out in two chunks, so that a fault can fall between them.
		parts = []string{full[:len(full)/2], full[len(full)/2:]}
	}
	// The part a fault stops the answer before: mid-answer, half a stream's events or the
	// first half of a JSON answer.
	cut := len(parts)
	switch fault {
	case MidClose, MidReset, MidSilence, ShortStream, MidError:
		cut = len(parts) / 2
	case NoDone:
		if f.Stream {
			cut = len(parts) - 1 // the [DONE] never comes, yet the stream ends cleanly
		}
	}
	if fault == MidError {
		parts = append(parts[:cut:cut], streamError, "data: [DONE]\n\n")
		cut = len(parts)
	}
	for _, p := range parts[:cut] {
		if !writeRaw(c, fmt.Sprintf("%x\r\n%s\r\n", len(p), p)) {
			return false
		}
		// Each part its own write, as an engine producing tokens sends them.
		time.Sleep(time.Millisecond)
	}
	switch fault {
	case MidClose:
		return false
	case MidReset:
		reset(c)
		return false
	case MidSilence:
		e.hang(c)
		return false
	case LateEnd:
		e.fault(LateEnd)
		select {
		case <-time.After(LateEndDelay):
		case <-e.stop:
			return false
		}
	}
	return writeRaw(c, "0\r\n\r\n")
}

// streamError is the error event vLLM's OpenAI server sends when a stream's generation
// raises (before its [DONE]).
const streamError = "data: {\"error\":{\"message\":\"the engine's step failed\",\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}\n\n"

// firstToken is the id of token t0; the prompt's ids, one per byte of its text, are below it.
const firstToken = 1000

// tokenEvents are a completions or chat stream's events for the request body: tokens t0 ...
// up to Chunks, or from where a prompt of ids leaves off, as many as max_tokens allows, then
// [DONE] (see Config.Chunks).
func (e *Engine) tokenEvents(body []byte, chat, ids bool) []string {
	var f struct {
		Prompt        json.RawMessage `json:"prompt"`
		MaxTokens     *int            `json:"max_tokens"`
		MaxCompletion *int            `json:"max_completion_tokens"`
	}
	json.Unmarshal(body, &f)
	var prompt []int
	if chat || json.Unmarshal(f.Prompt, &prompt) != nil {
		text := []byte(rawField(body, "messages"))
		if !chat {
			var s string
			json.Unmarshal(f.Prompt, &s)
			text = []byte(s)
		}
		prompt = make([]int, len(text))
		for i, b := range text {
			prompt[i] = int(b)
		}
	}
	start := 0
	for _, id := range prompt {
		if id >= firstToken {
			start++
		}
	}
	end, finish := e.cfg.Chunks, "stop"
	limit := f.MaxTokens
	if chat && f.MaxCompletion != nil {
		limit = f.MaxCompletion
	}
	if limit != nil && start+*limit < end {
		end, finish = start+*limit, "length"
	}
	promptIDs, _ := json.Marshal(prompt)
	var events []string
	for i := start; i < end; i++ {
		fr := "null"
		if i == end-1 {
			fr = strconv.Quote(finish)
		}
		var top, choice string
		if ids {
			choice = fmt.Sprintf(`,"token_ids":[%d]`, firstToken+i)
			if i == start && chat {
				top = `,"prompt_token_ids":` + string(promptIDs)
			} else if i == start {
				choice += `,"prompt_token_ids":` + string(promptIDs)
			}
		}
		if chat {
			events = append(events, fmt.Sprintf(`data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m"%s,"choices":[{"index":0,"delta":{"content":"t%d"},"finish_reason":%s%s}]}`+"\n\n", top, i, fr, choice))
		} else {
			events = append(events, fmt.Sprintf(`data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"t%d","finish_reason":%s%s}]}`+"\n\n", i, fr, choice))
		}
	}
	return append(events, "data: [DONE]\n\n")
}

// generateEvents are a token-in generate stream's events for the request body: token ids
// 1000 ... up to Chunks, as many as sampling_params' max_tokens allows, one per event, then
// [DONE].
func (e *Engine) generateEvents(body []byte) []string {
	var f struct {
		SamplingParams struct {
			MaxTokens *int `json:"max_tokens"`
		} `json:"sampling_params"`
	}
	json.Unmarshal(body, &f)
	end, finish := e.cfg.Chunks, "stop"
	if limit := f.SamplingParams.MaxTokens; limit != nil && *limit < end {
		end, finish = *limit, "length"
	}
	var events []string
	for i := range end {
		fr := "null"
		if i == end-1 {
			fr = strconv.Quote(finish)
		}
		events = append(events, fmt.Sprintf(`data: {"request_id":"generate-tokens-c","choices":[{"index":0,"logprobs":null,"finish_reason":%s,"token_ids":[%d]}],"usage":null}`+"\n\n", fr, firstToken+i))
	}
	return append(events, "data: [DONE]\n\n")
}

// sendsHead reports whether an engine with fault answers 200: an SGLang prefiller then did
// its transfer.
func sendsHead(f Fault) bool {
	switch f {
	case Status500, Status503, Status400, Status400Huge, Status422Empty, CloseAfterRead, Silent:
		return false
	}
	return true
}

// waitRoom waits for room's KV, or for the peer to close c (false) or the engine to stop.
func (e *Engine) waitRoom(c net.Conn, room chan struct{}) bool {
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		var b [1]byte
		c.Read(b[:]) // nothing comes on an idle keep-alive connection but its end
	}()
	select {
	case <-room:
		c.SetReadDeadline(time.Now())
		<-closed
		c.SetReadDeadline(time.Time{})
		return true
	case <-closed:
		return false
	case <-e.stop:
		return false
	}
}

func rawField(body []byte, name string) json.RawMessage {
	var m map[string]json.RawMessage
	if json.Unmarshal(body, &m) != nil {
		return nil
	}
	return m[name]
}

func writeRaw(c net.Conn, s string) bool {
	_, err := io.WriteString(c, s)
	return err == nil
}

func writeJSON(c net.Conn, status int, body string) bool {
	return writeRaw(c, fmt.Sprintf("HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		status, http.StatusText(status), len(body), body))
}
