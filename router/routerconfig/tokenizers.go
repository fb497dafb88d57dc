package routerconfig

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
)

// Tokenizer tokenizes a request at one engine: cmd/proxy passes engine's, which calls
// the engine's POST /tokenize. The call goes to baseURL (scheme://host:port, no trailing
// slash) through client, the backend's own (its key, its CA), within ctx. It tokenizes
// prompt, or, when messages is set, the messages rendered as the engine renders the request.
type Tokenizer interface {
	Tokenize(ctx context.Context, client *http.Client, baseURL, model, prompt string, messages json.RawMessage) ([]uint32, error)
}

// LocalTokenizer tokenizes one model's requests in the proxy, as its engines do: cmd/proxy
// passes one per entry of Config.Tokenizers, read from its files.
type LocalTokenizer interface {
	// Tokenize appends to dst prompt's tokens, or, when messages (a chat's messages array
	// as the client sent it) is set, the tokens of the messages rendered through the
	// model's chat template with the generation prompt. ErrNotLocal means this request is
	// the engine's to tokenize (a chat without a template, content the template would see
	// otherwise than the engine does). It appends at most max tokens: a request that has
	// more answers ErrTooManyTokens, tokenized no further than that, time and memory alike.
	Tokenize(dst []uint32, prompt string, messages json.RawMessage, max int) ([]uint32, error)
	// Chats reports whether it renders chat messages (it has the model's template).
	Chats() bool
}

// ErrNotLocal is a LocalTokenizer's answer for a request it leaves to the engine.
var ErrNotLocal = errors.New("router: this request is tokenized by the engine")

// ErrTooManyTokens is a LocalTokenizer's answer, and router.Router.Tokens', for a request of more
// tokens than tokenize_max_tokens: no engine takes it whole, and it is scored by its text.
var ErrTooManyTokens = errors.New("router: more tokens than tokenize_max_tokens")
