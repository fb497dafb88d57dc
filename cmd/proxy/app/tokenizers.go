package app

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"sync"
	"unsafe"

	"github.com/pdproxy/pdproxy/internal/hftok"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// LoadTokenizers reads the files of the router config's tokenizers, one LocalTokenizer per
// model, and refuses them where they cannot take effect: no policy routes by tokens and no
// pd_uncached_token_threshold weighs them, so nothing would ever tokenize a request.
func LoadTokenizers(p proxy.Config, r routerconfig.Config) (map[string]routerconfig.LocalTokenizer, error) {
	if len(r.Tokenizers) == 0 {
		return nil, nil
	}
	if !r.UsesTokens() && p.PDUncachedTokenThreshold <= 0 {
		return nil, fmt.Errorf("tokenizers: set, but no request is ever tokenized: neither policy is precise_cache_aware and pd_uncached_token_threshold is off")
	}
	out := make(map[string]routerconfig.LocalTokenizer, len(r.Tokenizers))
	for _, model := range slices.Sorted(maps.Keys(r.Tokenizers)) {
		files := r.Tokenizers[model]
		if files.File == "" {
			continue // Validate says so, with the key's name
		}
		tok, err := hftok.LoadFile(files.File)
		if err != nil {
			return nil, fmt.Errorf("tokenizers.%s.file: %w", model, err)
		}
		lt := &localTokenizer{tok: tok}
		if files.ChatTemplate != "" {
			if lt.chat, err = hftok.LoadTemplate(files.ChatTemplate); err != nil {
				return nil, fmt.Errorf("tokenizers.%s.chat_template: %w", model, err)
			}
		}
		out[model] = lt
	}
	return out, nil
}

// localTokenizer is a model's tokenizer.json and chat template, as routerconfig.LocalTokenizer.
// A completion's prompt gets its post-processor's tokens, as vLLM's /tokenize and
// completions add them; a rendered chat does not (its template writes them), as vLLM's
// chat does not add them on top.
type localTokenizer struct {
	tok  *hftok.Tokenizer
	chat *hftok.Template // nil: chats are the engine's
	// texts are buffers to render chats into (*[]byte): a chat's text lives only until its
	// tokens are out, and the tokenizer keeps none of it.
	texts sync.Pool
}

// maxKeptText bounds the buffers a localTokenizer keeps for rendered chats: a rare huge
// chat's is left to the collector.
const maxKeptText = 1 << 20

var _ routerconfig.LocalTokenizer = (*localTokenizer)(nil)

func (t *localTokenizer) Chats() bool { return t.chat != nil }

func (t *localTokenizer) Tokenize(dst []uint32, prompt string, messages json.RawMessage, max int) ([]uint32, error) {
	if messages == nil {
		return encode(t.tok, dst, prompt, true, max)
	}
	if t.chat == nil {
		return dst, routerconfig.ErrNotLocal
	}
	msgs, ok := plainMessages(messages)
	if !ok {
		return dst, routerconfig.ErrNotLocal
	}
	buf, _ := t.texts.Get().(*[]byte)
	if buf == nil {
		buf = new([]byte)
	}
	defer func() {
		if cap(*buf) <= maxKeptText {
			t.texts.Put(buf)
		}
	}()
	text, err := t.chat.AppendRender((*buf)[:0], msgs, true)
	*buf = text
	if err != nil {
		return dst, err
	}
	// The string is a view of the buffer, which nothing writes until it is back in the pool:
	// Encode keeps copies of what it caches, never the text.
	return encode(t.tok, dst, unsafe.String(unsafe.SliceData(text), len(text)), false, max)
}

// encode appends text's tokens to dst, at most max of them: a text of more answers
// routerconfig.ErrTooManyTokens, and dst as it was.
func encode(tok *hftok.Tokenizer, dst []uint32, text string, addSpecialTokens bool, max int) ([]uint32, error) {
	n := len(dst)
	out, whole, err := tok.AppendEncodeMax(dst, text, addSpecialTokens, max)
	if err == nil && !whole {
		return out[:n], routerconfig.ErrTooManyTokens
	}
	return out, err
}
