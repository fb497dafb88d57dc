package api

import (
	"encoding/binary"
	"encoding/json"

	"github.com/cespare/xxhash/v2"

	"github.com/pdproxy/pdproxy/engine"
)

// A request's cache key: what vLLM keys its prompt's KV blocks by beyond the tokens
// (vllm/v1/core/kv_cache_utils.py, generate_block_hash_extra_keys): the LoRA adapter's
// name, the request's cache_salt, and the identifiers of its multimodal items. The first two
// the proxy reads and hands to the router (router.Hint's LoRA and CacheSalt), which matches
// the prompt's tokens only against blocks stored under them. The third it cannot derive
// (vLLM hashes each item's processed data and places its tokens by its processor): a
// request with images, audio, video or embeddings is scored as holding nothing by a policy
// that scores by tokens, never as a hit its items would make false.

// cacheKey is what of a request's cache key the proxy knows.
type cacheKey struct {
	// Salt is the request's cache_salt, empty for none (vLLM takes "" as none).
	Salt string
	// LoRA is the request's model when the engines serve it as a LoRA adapter.
	LoRA string
	// Media is set when the prompt holds items the engines key by identifiers the proxy
	// cannot derive: content parts other than text (images, audio, video, files,
	// embeddings), or a completion's prompt_embeds.
	Media bool
}

// textParts are the content part types that hold text, which the engines tokenize as any
// text: every other type is an item of a modality the proxy cannot key.
var textParts = map[string]bool{"text": true, "input_text": true, "output_text": true, "refusal": true, "thinking": true,
	"reasoning": true, "reasoning_text": true, "summary_text": true}

// hasMedia reports whether a message's content (a string, or an array of parts) holds a
// part of a type other than text.
func hasMedia(content json.RawMessage) bool {
	if len(content) == 0 || content[0] != '[' {
		return false
	}
	var parts []struct {
		Type    string          `json:"type"`
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(content, &parts) != nil {
		return false
	}
	for _, p := range parts {
		if p.Type != "" && !textParts[p.Type] || hasMedia(p.Content) {
			return true
		}
	}
	return false
}

// messagesHaveMedia reports whether any message of a chat's messages array (or a Responses
// input's items) holds a part other than text.
func messagesHaveMedia(raw json.RawMessage) bool {
	var msgs []struct {
		Content json.RawMessage `json:"content"`
	}
	if len(raw) == 0 || raw[0] != '[' || json.Unmarshal(raw, &msgs) != nil {
		return false
	}
	for _, m := range msgs {
		if hasMedia(m.Content) {
			return true
		}
	}
	return false
}

// RouteText is text as cache-aware policies match it: behind a tag of the request's LoRA
// and cache_salt when it has either, so that the approximate view, which knows nothing of
// KV keys, never credits one adapter's or tenant's text to another's request (the tag's
// first byte differs from the text's, or from another tag's, but one time in 256). A
// request of neither routes on its text as it is.
func RouteText(text string, k cacheKey) string {
	if k.LoRA == "" && k.Salt == "" || text == "" {
		return text
	}
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString(k.LoRA)
	_, _ = d.Write([]byte{0})
	_, _ = d.WriteString(k.Salt)
	var tag [8]byte
	binary.BigEndian.PutUint64(tag[:], d.Sum64())
	return string(tag[:]) + text
}

// completionMedia reports whether a completion's body carries prompt embeddings, which the
// engines key by their hash.
func completionMedia(fields *engine.Fields) bool {
	raw, ok := fields.Field("prompt_embeds")
	return ok && !isNull(raw)
}

// maxTurnEnds is how many of a conversation's last message ends a request keeps (TurnEnds).
const maxTurnEnds = 5

// messageEnds are the byte offsets in text, a JSON array of messages, just past each of its
// last keep elements, oldest first: where the text an earlier request of the same
// conversation sent ends, the array as it grew (a turn adds an answer and a message or a few
// tool results). Nil for text that is not such an array.
func messageEnds(text string, keep int) []int {
	if len(text) == 0 || text[0] != '[' {
		return nil
	}
	ends := make([]int, 0, keep)
	depth, inString, escaped := 0, false, false
	for i := 0; i < len(text); i++ {
		c := text[i]
		switch {
		case escaped:
			escaped = false
		case inString:
			escaped, inString = c == '\\', c != '"'
		case c == '"':
			inString = true
		case c == '[' || c == '{':
			depth++
		case c == ']' || c == '}':
			depth--
			if depth == 1 {
				if len(ends) == keep {
					ends = append(ends[:0], ends[1:]...)
				}
				ends = append(ends, i+1)
			}
			if depth == 0 {
				return ends
			}
		}
	}
	return nil // not a whole array
}
