package engine

import (
	"encoding/json"
	"errors"
	"strconv"
)

// Continuer is an engine that can take up a generation another engine began: it accepts a
// completions prompt of token ids, and reports the ids it generates when asked
// (return_token_ids, vLLM 0.10.2 and later). A stream whose decoder failed goes on on such an
// engine, from the prompt's ids and the ones already sent to the client. vLLM's engines (NIXL
// and Mooncake) and the simulator have it; SGLang's OpenAI server reports no generated ids.
type Continuer interface {
	// ContinueBody is the body of a /v1/completions request that goes on with f's generation
	// (f a completions or chat body, as chat says) after the tokens of prompt, which are the
	// original prompt's ids followed by the ones already generated, of which generated were
	// output: the client's sampling members as they came, the token limits less what was
	// generated, streamed, with the generated ids reported. The members only a chat takes
	// (its messages, their template and tools) stay out: the prompt is already rendered.
	ContinueBody(f *Fields, chat bool, prompt []uint32, generated int) ([]byte, error)
}

var (
	_ Continuer = vllm{}
	_ Continuer = mooncake{}
)

// continueDrop is what a continuation leaves out of the client's body and sets itself, or
// what only a chat knows how to read.
var continueDrop = []string{
	"prompt", "messages", "stream", "max_tokens", "max_completion_tokens", "min_tokens",
	"min_completion_tokens", "kv_transfer_params", "return_token_ids", "echo", "suffix",
	"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "response_format",
	"chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
	"documents", "mm_processor_kwargs", "logprobs", "top_logprobs", "reasoning_effort", "include_reasoning",
}

// ErrNothingLeft is a continuation with no token left to generate under the client's limit.
var ErrNothingLeft = errors.New("the client's token limit is used up")

// ContinueBody implements Continuer for vLLM's OpenAI server.
func (vllm) ContinueBody(f *Fields, chat bool, prompt []uint32, generated int) ([]byte, error) {
	return continueBody(f, chat, prompt, generated)
}

// ContinueBody implements Continuer: Mooncake's engines are vLLM's.
func (mooncake) ContinueBody(f *Fields, chat bool, prompt []uint32, generated int) ([]byte, error) {
	return continueBody(f, chat, prompt, generated)
}

func continueBody(f *Fields, chat bool, prompt []uint32, generated int) ([]byte, error) {
	ids, err := json.Marshal(prompt)
	if err != nil {
		return nil, err
	}
	add := []set{{"prompt", ids}, {"stream", []byte("true")}, {"return_token_ids", []byte("true")}}
	limit, ok, err := intField(f, "max_tokens")
	if chat {
		if l, ok2, err2 := intField(f, "max_completion_tokens"); ok2 || err2 != nil {
			limit, ok, err = l, ok2, err2
		}
	}
	if err != nil {
		return nil, err
	}
	if ok {
		if limit-generated < 1 {
			return nil, ErrNothingLeft
		}
		add = append(add, set{"max_tokens", []byte(strconv.Itoa(limit - generated))})
	}
	minName := "min_tokens"
	if chat && f.has("min_completion_tokens") {
		minName = "min_completion_tokens"
	}
	if least, ok, err := intField(f, minName); err != nil {
		return nil, err
	} else if ok && least-generated > 0 {
		add = append(add, set{"min_tokens", []byte(strconv.Itoa(least - generated))})
	}
	return f.rewrite(continueDrop, add...), nil
}

// intField reads member key as an integer; ok is false when it is absent or null.
func intField(f *Fields, key string) (int, bool, error) {
	raw, found := f.Field(key)
	if !found || string(raw) == "null" {
		return 0, false, nil
	}
	var n int
	if err := json.Unmarshal(raw, &n); err != nil {
		return 0, false, errors.New(key + " is not an integer")
	}
	return n, true, nil
}
