package pdflow

import (
	"bytes"
	"encoding/json"
	"errors"
	"strconv"
	"sync/atomic"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"go.opentelemetry.io/otel/trace"
)

// A stream that survives its decoder. When the decoder of a stream fails after the client got
// its first byte (the connection broke, the stream ended before its end, an error event, the
// decoder went silent past decode_idle_timeout), the request goes on on another decoder, and
// under P/D another prefill: the prompt's token ids and those of every token the client got
// become a completions prompt, the token limits shrink by what was generated, the sampling is
// the client's, and the continuation's events are written as the same stream's (its id,
// created and model; chat chunks for a chat), so the client reads one answer. The engines
// report the ids (return_token_ids, which the proxy asks for and takes out again unless the
// client asked too). What cannot go on exactly fails as it would without: more than one
// choice, guided decoding, log probabilities, tools, output penalties, stop strings, an engine
// that cannot continue from ids.

// Why a stream had to leave its decoder: the reason label of pdproxy_migrations_total.
const (
	moveDecoderFailed = "decoder_failed"
	moveIdleTimeout   = "idle_timeout"
	moveErrorEvent    = "error_event"
	moveDrained       = "drained"
)

// The outcome label of pdproxy_migrations_total.
const (
	movedOn      = "migrated"
	moveRefused  = "not_migratable"
	moveExceeded = "limit_reached"
)

// Why a stream cannot go on exactly: the reason label of pdproxy_migrations_refused_total.
const (
	refuseN          = "n"
	refusePrompts    = "prompt_array"
	refuseGuided     = "guided_decoding"
	refuseLogprobs   = "logprobs"
	refuseTools      = "tools"
	refusePenalties  = "penalties"
	refuseStop       = "stop"
	refuseEngine     = "engine"
	refuseTooLong    = "too_long"
	refuseNoTokenIDs = "no_token_ids"
	refuseFinished   = "finished"
	refuseNothing    = "no_tokens_left"
)

// resume is what a migratable stream keeps to go on elsewhere: the ids of its prompt and of
// every token its client got, what the client's stream is called, and how many more times it
// may move.
type resume struct {
	// left is how many more times the stream may move.
	left int
	// maxIDs bounds prompt and sent together; past it the stream stops keeping them.
	maxIDs int
	// refused, when set, is why the stream cannot go on exactly (a refuse* reason).
	refused string
	chat    bool
	// clientIDs: the client asked for return_token_ids itself, and sees them.
	clientIDs bool
	// prompt are the prompt's ids, from the first answer; sent the ids of the tokens whose
	// events went to the client.
	prompt, sent []uint32
	// id, created and model are the first answer's, raw: a continuation's events carry them.
	id, created, model []byte
	// Attempt counts the attempts before the one under way.
	Attempt int
	// pending is the start of an event whose end has not come yet.
	pending []byte
	// errorEvent: the decoder sent an error event, which was kept from the client.
	errorEvent bool
	// finished: an event with a finish_reason went to the client.
	finished bool
	// watching: the decoder's going away is watched (watchdog.cutWhenLeaving); movable says,
	// for that watch's goroutine, whether the stream could go on elsewhere now.
	watching bool
	movable  atomic.Bool
	// client is the body the client sent: every continuation is built from it, with all the
	// tokens sent so far, not from the continuation before it.
	client *engine.Fields
	// withIDs is the client's body asking for the token ids, for a first decode on an engine
	// that reports them (fieldsFor); nil when the client asked itself, or the stream cannot
	// move anyway. A continuation's body asks for them already.
	withIDs *engine.Fields
}

// fieldsFor is the client's body as decoder b gets it: asking for the token ids where the
// stream may move and b's engine reports them. Other engines never see the member.
func (x *Exchange) fieldsFor(b *router.Backend) *engine.Fields {
	if rs := x.Out.Resume; rs != nil && rs.withIDs != nil && continuable(b.Engine) {
		return rs.withIDs
	}
	return x.Req.Fields
}

// PlanResume readies a stream for migration, when migration_limit allows it: the engines are
// asked for the token ids, and what would keep the stream from going on exactly is noted.
func (x *Exchange) PlanResume() *api.Error {
	switch x.Req.API {
	case engine.APIResponses, engine.APIMessages, engine.APIGenerate:
		// Only completion and chat streams are continued: a generate stream's continuation
		// would extend token_ids and lower sampling_params' max_tokens, which the resume
		// does not rewrite.
		return nil
	}
	if x.s.cfg.MigrationLimit <= 0 || !x.Req.Stream {
		return nil
	}
	rs := &resume{left: x.s.cfg.MigrationLimit, maxIDs: x.s.cfg.MigrationMaxTokens, chat: x.Req.API == engine.APIChat, refused: unresumable(x.Req),
		client: x.Req.Fields}
	if raw, ok := x.Req.Fields.Field("return_token_ids"); ok && string(raw) == "true" {
		rs.clientIDs = true
	} else if rs.refused == "" {
		f, err := x.Req.Fields.With("return_token_ids", []byte("true"))
		if err != nil {
			return BuildFailed(err, "engine")
		}
		rs.withIDs = f
	}
	x.Out.Resume = rs
	return nil
}

// unresumable is why req's stream could not go on exactly on another engine, "" when it can.
func unresumable(req *api.Request) string {
	f := req.Fields
	set := func(key string) bool {
		raw, ok := f.Field(key)
		if !ok {
			return false
		}
		switch string(bytes.TrimSpace(raw)) {
		case "null", "false", "0", "0.0", `""`, "[]", "{}":
			return false
		}
		return true
	}
	switch {
	case req.DecodeOnly == api.DecodeOnlyN:
		return refuseN
	case req.Prompts > 1:
		return refusePrompts
	case set("guided_json"), set("guided_regex"), set("guided_choice"), set("guided_grammar"), set("structural_tag"),
		set("structured_outputs"), guidedFormat(f):
		return refuseGuided
	case set("logprobs"), set("top_logprobs"), set("prompt_logprobs"), set("echo"):
		return refuseLogprobs
	case set("tools") && !toolChoiceNone(f), set("functions"):
		return refuseTools
	case set("presence_penalty"), set("frequency_penalty"):
		// vLLM applies them to the generated tokens only: in a continuation those are prompt.
		return refusePenalties
	case set("stop"):
		// A stop string that began before the break would not be seen after it.
		return refuseStop
	}
	return ""
}

// guidedFormat reports whether a response_format constrains the output (a JSON schema, a JSON
// object, a structural tag), as opposed to plain text.
func guidedFormat(f *engine.Fields) bool {
	raw, ok := f.Field("response_format")
	if !ok {
		return false
	}
	var rf struct {
		Type string `json:"type"`
	}
	if json.Unmarshal(raw, &rf) != nil {
		return string(bytes.TrimSpace(raw)) != "null"
	}
	return rf.Type != "" && rf.Type != "text"
}

func toolChoiceNone(f *engine.Fields) bool {
	raw, ok := f.Field("tool_choice")
	return ok && string(bytes.TrimSpace(raw)) == `"none"`
}

// canMove reports whether the stream may go on elsewhere after its decoder failed with err,
// counting the refusals of one that may not.
func (x *Exchange) canMove(err error) bool {
	rs := x.Out.Resume
	if rs == nil || !x.Out.Wrote || x.Ctx.Err() != nil {
		return false
	}
	reason := moveReason(err)
	refuse := func(why string) bool {
		x.s.m.Migrations.WithLabelValues(reason, moveRefused).Inc()
		x.s.m.MigrationRefusals.WithLabelValues(why).Inc()
		return false
	}
	switch {
	case rs.refused != "":
		return refuse(rs.refused)
	case rs.finished:
		return refuse(refuseFinished)
	case !continuable(x.Legs.Decode.Engine):
		// Checked before the ids: such an engine is never asked for them.
		return refuse(refuseEngine)
	case rs.prompt == nil:
		return refuse(refuseNoTokenIDs)
	case rs.left <= 0:
		x.s.m.Migrations.WithLabelValues(reason, moveExceeded).Inc()
		return false
	}
	return true
}

func moveReason(err error) string {
	switch {
	case errors.Is(err, errErrorEvent):
		return moveErrorEvent
	case errors.Is(err, errIdleTimeout):
		return moveIdleTimeout
	case errors.Is(err, errDecoderLeaving):
		return moveDrained
	}
	return moveDecoderFailed
}

// moveOn readies the next attempt of a stream whose decoder failed with cause: the decoder's
// lease goes back charged with the failure, the table starts another attempt, and the request
// becomes the continuation. It returns the custody, holding nothing, for the next attempt; it
// ends it when it fails.
func (x *Exchange) moveOn(c custody, cause error) (custody, *api.Error) {
	rs := x.Out.Resume
	reason := moveReason(cause)
	dead := x.Legs.Decode
	c = c.withoutLease(resultOf(cause, nil))
	x.Tries.avoid = append(x.Tries.avoid, avoidOf(dead))
	prompt := make([]uint32, 0, len(rs.prompt)+len(rs.sent))
	prompt = append(append(prompt, rs.prompt...), rs.sent...)
	body, err := engineOf(dead).(engine.Continuer).ContinueBody(rs.client, rs.chat, prompt, len(rs.sent))
	if errors.Is(err, engine.ErrNothingLeft) {
		x.s.m.Migrations.WithLabelValues(reason, moveRefused).Inc()
		x.s.m.MigrationRefusals.WithLabelValues(refuseNothing).Inc()
		return custody{}, x.failWith(c, router.Result{}, api.FromBackend(cause, routerconfig.RoleDecode, api.KindDecodeTimeout))
	}
	var fields *engine.Fields
	if err == nil {
		fields, err = engine.ParseFields(body)
	}
	if err != nil {
		return custody{}, x.failWith(c, router.Result{}, BuildFailed(err, "continuation"))
	}
	if !x.s.table.Continue(x.ID) {
		return custody{}, x.gone(c)
	}
	x.s.m.Migrations.WithLabelValues(reason, movedOn).Inc()
	x.s.m.TokensReplayed.Add(float64(len(rs.sent)))
	if x.span != nil {
		x.span.AddEvent("migration", trace.WithAttributes(attrMigrationReason.String(reason), attrBackend.String(dead.Name),
			attrMigrationTokens.Int(len(rs.sent))))
	}
	// Each attempt is a new request to the engines: an abort repeated for the last one must
	// never reach this one.
	x.EngineID = api.NewID()
	c.engineID = x.EngineID
	rs.Attempt++
	rs.left--
	rs.pending = rs.pending[:0]
	rs.errorEvent, rs.watching = false, false
	rs.movable.Store(false)
	rs.withIDs = nil
	x.Req = &api.Request{Route: "/v1/completions", Fields: fields, Model: x.Req.Model, Stream: true, Prefix: x.Req.Prefix,
		Text: x.Req.Text, Key: x.Req.Key, RouteText: x.Req.RouteText, Tokens: prompt, Prompts: 1}
	x.Legs = legs{Named: x.Legs.Named}
	return c, nil
}

// filter takes what a decoder sent and answers what of it goes to the client: whole events
// only (the start of one waits for its end), each with the generated ids noted, the ids taken
// out unless the client asked for them, and, in a continuation, renamed as the first answer's
// events (a chat's as chat chunks). An error event stops it: what follows is not passed on.
func (rs *resume) filter(data []byte) []byte {
	if rs.errorEvent {
		return nil
	}
	rs.pending = append(rs.pending, data...)
	var out []byte
	for {
		i := bytes.Index(rs.pending, []byte("\n\n"))
		if i < 0 {
			break
		}
		ev := rs.pending[:i+2]
		ev2, ok := rs.event(ev)
		if !ok {
			rs.errorEvent = true
			rs.pending = rs.pending[:0]
			return out
		}
		out = append(out, ev2...)
		rs.pending = rs.pending[i+2:]
	}
	if len(rs.pending) == 0 {
		rs.pending = rs.pending[:0:0] // let a large read's buffer go
	}
	if rs.maxIDs > 0 && len(rs.prompt)+len(rs.sent) > rs.maxIDs && rs.refused == "" {
		rs.refused, rs.prompt, rs.sent = refuseTooLong, nil, nil
	}
	rs.movable.Store(rs.refused == "" && !rs.finished && rs.prompt != nil && rs.left > 0)
	return out
}

// event rewrites one whole event; ok is false for an error event.
func (rs *resume) event(ev []byte) ([]byte, bool) {
	line := bytes.TrimRight(ev, "\n")
	payload, isData := bytes.CutPrefix(line, []byte("data:"))
	if !isData || bytes.IndexByte(line, '\n') >= 0 {
		return ev, true // comments, other fields, several lines: not an answer chunk
	}
	payload = bytes.TrimLeft(payload, " ")
	if bytes.Equal(payload, []byte("[DONE]")) {
		return ev, true
	}
	f, err := engine.ParseFields(payload)
	if err != nil {
		return ev, true
	}
	if _, bad := f.Field("error"); bad {
		return nil, false
	}
	if obj, _ := f.Field("object"); string(obj) == `"error"` {
		return nil, false
	}
	if rs.Attempt == 0 {
		if rs.id == nil {
			rs.id, rs.created, rs.model = member(f, "id"), member(f, "created"), member(f, "model")
		}
		if ids, ok := f.Field("prompt_token_ids"); ok && rs.prompt == nil {
			rs.prompt = decodeIDs(ids)
		}
	}
	choices, edited := rs.choices(f)
	var body []byte
	switch {
	case rs.Attempt == 0 && !edited && (rs.clientIDs || !hasAny(f, "prompt_token_ids")):
		return ev, true
	case rs.Attempt == 0:
		drop := []string{}
		if !rs.clientIDs {
			drop = append(drop, "prompt_token_ids")
		}
		body = f.Edit(drop, engine.Member{Key: "choices", Val: choices})
	case rs.chat:
		body = rs.chatChunk(f, choices)
	default:
		set := []engine.Member{{Key: "id", Val: rs.id}, {Key: "created", Val: rs.created}, {Key: "model", Val: rs.model},
			{Key: "choices", Val: choices}}
		if u, ok := rs.usage(f); ok {
			set = append(set, engine.Member{Key: "usage", Val: u})
		}
		body = f.Edit([]string{"prompt_token_ids"}, set...)
	}
	out := make([]byte, 0, len(body)+8)
	out = append(out, "data: "...)
	out = append(out, body...)
	return append(out, "\n\n"...), true
}

// choices notes the generated ids of an event's choices and answers the choices as the client
// sees them: the ids and, in a continuation, the completions prompt's ids taken out unless the
// client asked for them, and a continuation's completion choices as chat choices for a chat.
// edited is false when they stay as they came.
func (rs *resume) choices(f *engine.Fields) (out []byte, edited bool) {
	raw, ok := f.Field("choices")
	if !ok {
		return nil, false
	}
	var list []json.RawMessage
	if json.Unmarshal(raw, &list) != nil {
		return raw, false
	}
	edited = rs.Attempt > 0
	out = append(out, '[')
	for i, c := range list {
		cf, err := engine.ParseFields(c)
		if err != nil {
			return raw, false
		}
		if ids, ok := cf.Field("token_ids"); ok {
			rs.sent = append(rs.sent, decodeIDs(ids)...)
		}
		if ids, ok := cf.Field("prompt_token_ids"); ok && rs.Attempt == 0 && rs.prompt == nil {
			rs.prompt = decodeIDs(ids)
		}
		if fr, ok := cf.Field("finish_reason"); ok && string(fr) != "null" {
			rs.finished = true
		}
		if i > 0 {
			out = append(out, ',')
		}
		var drop []string
		if !rs.clientIDs {
			drop = []string{"token_ids"}
		}
		if rs.Attempt > 0 || !rs.clientIDs {
			// A completion's prompt ids are on its choice: the client sees them only when it
			// asked, and never a continuation's, whose prompt is not the client's.
			drop = append(drop, "prompt_token_ids")
		}
		if rs.Attempt > 0 && rs.chat {
			out = append(out, chatChoice(cf, rs.clientIDs)...)
			continue
		}
		if len(drop) == 0 || !hasAny(cf, drop...) {
			out = append(out, c...)
			continue
		}
		edited = true
		out = append(out, cf.Edit(drop)...)
	}
	return append(out, ']'), edited
}

// chatChoice is a continuation's completion choice as a chat chunk's: its text as the delta's
// content, its finish and stop reasons, and its ids when the client asked for them.
func chatChoice(cf *engine.Fields, ids bool) []byte {
	out := []byte(`{"index":`)
	if v, ok := cf.Field("index"); ok {
		out = append(out, v...)
	} else {
		out = append(out, '0')
	}
	out = append(out, `,"delta":{"content":`...)
	if v, ok := cf.Field("text"); ok {
		out = append(out, v...)
	} else {
		out = append(out, `""`...)
	}
	out = append(out, `},"logprobs":null,"finish_reason":`...)
	if v, ok := cf.Field("finish_reason"); ok {
		out = append(out, v...)
	} else {
		out = append(out, "null"...)
	}
	if v, ok := cf.Field("stop_reason"); ok {
		out = append(out, `,"stop_reason":`...)
		out = append(out, v...)
	}
	if v, ok := cf.Field("token_ids"); ok && ids {
		out = append(out, `,"token_ids":`...)
		out = append(out, v...)
	}
	return append(out, '}')
}

// chatChunk is a continuation's completion event as a chat chunk of the first answer.
func (rs *resume) chatChunk(f *engine.Fields, choices []byte) []byte {
	out := []byte(`{"id":`)
	out = append(out, rs.id...)
	out = append(out, `,"object":"chat.completion.chunk","created":`...)
	out = append(out, rs.created...)
	out = append(out, `,"model":`...)
	out = append(out, rs.model...)
	out = append(out, `,"choices":`...)
	if choices == nil {
		choices = []byte("[]")
	}
	out = append(out, choices...)
	if u, ok := rs.usage(f); ok {
		out = append(out, `,"usage":`...)
		out = append(out, u...)
	}
	return append(out, '}')
}

// usage is a continuation's usage as the client's stream counts it: the original prompt, and
// every token generated for the client.
func (rs *resume) usage(f *engine.Fields) ([]byte, bool) {
	raw, ok := f.Field("usage")
	if !ok || string(raw) == "null" {
		return nil, false
	}
	uf, err := engine.ParseFields(raw)
	if err != nil {
		return raw, true
	}
	p, g := len(rs.prompt), len(rs.sent)
	return uf.Edit(nil, engine.Member{Key: "prompt_tokens", Val: strconv.AppendInt(nil, int64(p), 10)},
		engine.Member{Key: "completion_tokens", Val: strconv.AppendInt(nil, int64(g), 10)},
		engine.Member{Key: "total_tokens", Val: strconv.AppendInt(nil, int64(p+g), 10)}), true
}

// member is a copy of f's member key, or null.
func member(f *engine.Fields, key string) []byte {
	if v, ok := f.Field(key); ok {
		return bytes.Clone(v)
	}
	return []byte("null")
}

func hasAny(f *engine.Fields, keys ...string) bool {
	for _, k := range keys {
		if _, ok := f.Field(k); ok {
			return true
		}
	}
	return false
}

// decodeIDs reads a JSON list of token ids; nil when it is none.
func decodeIDs(raw json.RawMessage) []uint32 {
	var ids []uint32
	if json.Unmarshal(raw, &ids) != nil {
		return nil
	}
	if ids == nil {
		ids = []uint32{}
	}
	return ids
}
