package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// maxTokenizeBytes bounds a /tokenize answer: a prompt of a million tokens is well under.
const maxTokenizeBytes = 32 << 20

// Tokenizer tokenizes a prompt with an engine's POST /tokenize, which vLLM, SGLang and the
// sim serve alike. Its zero value is ready to use.
type Tokenizer struct{}

// tokenizeBody is POST /tokenize's body, vLLM's and SGLang's.
type tokenizeBody struct {
	Model               string          `json:"model,omitempty"`
	Prompt              *string         `json:"prompt,omitempty"`
	Messages            json.RawMessage `json:"messages,omitempty"`
	AddGenerationPrompt bool            `json:"add_generation_prompt,omitempty"`
}

// Tokenize returns the token ids of a completion's prompt, or, when messages (a chat's
// messages array as the client sent it) is set, of the messages rendered through the
// engine's chat template with the generation prompt, as the engine will render the request.
// The call goes to baseURL (scheme://host:port, no trailing slash) through client, which
// carries the engine's key and TLS settings, and lasts as long as ctx allows.
func (Tokenizer) Tokenize(ctx context.Context, client *http.Client, baseURL, model, prompt string, messages json.RawMessage) ([]uint32, error) {
	body := tokenizeBody{Model: model}
	if len(messages) > 0 {
		body.Messages, body.AddGenerationPrompt = messages, true
	} else {
		body.Prompt = &prompt
	}
	data, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("POST /tokenize: %w", err)
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+"/tokenize", bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(hr)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
		return nil, fmt.Errorf("POST /tokenize answered %d", resp.StatusCode)
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	dec := json.NewDecoder(io.LimitReader(resp.Body, maxTokenizeBytes))
	if err := dec.Decode(&out); err != nil {
		return nil, fmt.Errorf("POST /tokenize: %w", err)
	}
	if out.Tokens == nil {
		return nil, errors.New("POST /tokenize: no tokens in the answer")
	}
	return out.Tokens, nil
}
