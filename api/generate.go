package api

import (
	"encoding/json"
	"fmt"
	"math"

	"github.com/pdproxy/pdproxy/engine"
)

// vLLM's token-in route, POST /inference/v1/generate (vllm/entrypoints/serve/disagg,
// GenerateRequest): a prompt of token ids, the sampling parameters in an object of their own,
// and at the top model, stream, stream_options, cache_salt, priority and kv_transfer_params. It
// is served as a completion is, under P/D and with every abort rule: the prefill and the drain
// bound sampling_params' max_tokens to one (engine.APIGenerate), the decoder gets the
// client's body and the prefiller's params, and its answer, or its stream of token ids ending
// in [DONE], is relayed as it comes. The proxy needs model to pick engines (vLLM takes its
// served model when a body has none). A stream of it does not move to another decoder
// (migration): it fails as a completion that cannot move does.

// GenerateRoute is the token-in route's path.
const GenerateRoute = "/inference/v1/generate"

// ParseGenerate validates a body of the token-in route. Errors name the member, a
// member of sampling_params as sampling_params.<name>.
func ParseGenerate(body []byte) (*Request, *Error) {
	req, e := parseGeneration(body)
	if e != nil {
		return nil, e
	}
	req.API = engine.APIGenerate
	fields := req.Fields
	if e := checkStreamOptions(fields); e != nil {
		return nil, e
	}
	if _, _, e := CountField(fields, "priority", math.MinInt64); e != nil {
		return nil, e
	}
	if e := parseTokenIDs(fields, req); e != nil {
		return nil, e
	}
	raw, ok := fields.Field("sampling_params")
	if !ok || isNull(raw) {
		return nil, BadRequest("sampling_params", "sampling_params is required")
	}
	var sp rawObject
	if err := json.Unmarshal(raw, &sp); err != nil || sp == nil {
		return nil, BadRequest("sampling_params", "sampling_params must be an object")
	}
	counts, e := checkSampling(sp)
	if e != nil {
		e.Param = "sampling_params." + e.Param
		e.Message = "sampling_params." + e.Message
		return nil, e
	}
	// Items of other modalities are placed and keyed by what the engine's renderer made of
	// them: the proxy cannot match them.
	for _, name := range []string{"features", "content_parts"} {
		if raw, ok := fields.Field(name); ok && !isNull(raw) {
			req.Key.Media = true
		}
	}
	_, promptLogprobs := counts["prompt_logprobs"]
	switch {
	case counts["n"] > 1 || counts["best_of"] > 1:
		req.DecodeOnly = DecodeOnlyN
	case promptLogprobs:
		req.DecodeOnly = DecodeOnlyPromptLogprobs
	}
	return req, nil
}

// parseTokenIDs reads token_ids, the prompt: a non-empty array of token ids, each below 2^32
// (no vocabulary is that large). The array as it came is the text cache-aware policies match:
// a later turn's ids extend it.
func parseTokenIDs(fields *engine.Fields, req *Request) *Error {
	raw, ok := fields.Field("token_ids")
	if !ok || isNull(raw) {
		return BadRequest("token_ids", "token_ids is required")
	}
	var ids []json.RawMessage
	if json.Unmarshal(raw, &ids) != nil || len(ids) == 0 {
		return BadRequest("token_ids", "token_ids must be a non-empty array of token ids")
	}
	req.Tokens = make([]uint32, len(ids))
	for i, id := range ids {
		v, ok := plainInt(id)
		if !ok || v < 0 || v > math.MaxUint32 {
			return BadRequest("token_ids", fmt.Sprintf("token_ids[%d] must be a token id: an integer from 0 below 2^32", i))
		}
		req.Tokens[i] = uint32(v)
	}
	req.Prefix, req.Text, req.Prompts = string(raw), string(raw), 1
	return nil
}

// checkSampling checks the members of sampling_params the proxy knows, as a completion's are
// checked at the top of its body (vLLM's SamplingParams takes the same names), and returns the
// counts that are there.
func checkSampling(sp rawObject) (map[string]int64, *Error) {
	counts := make(map[string]int64, len(countFields))
	for _, c := range countFields {
		v, present, e := CountField(sp, c.name, c.min)
		if e != nil {
			return nil, e
		}
		if present {
			counts[c.name] = v
		}
	}
	if _, _, e := CountField(sp, "logprobs", 0); e != nil {
		return nil, e
	}
	for _, name := range numberFields {
		if e := numberField(sp, name); e != nil {
			return nil, e
		}
	}
	for _, name := range intFields {
		if _, _, e := CountField(sp, name, math.MinInt64); e != nil {
			return nil, e
		}
	}
	for _, name := range boolFields {
		var v bool
		if e := boolField(sp, name, &v); e != nil {
			return nil, e
		}
	}
	return counts, stopField(sp)
}
