package sim

import (
	"fmt"
	"hash/fnv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/pdproxy/pdproxy/internal/hftok"
)

// The sim's tokenizer: deterministic, with real token ids, and cheap. It is
// no model's tokenizer; what matters to a cache-aware router is that it is
// stable under extension, as BPE tokenizers are in practice: the tokens of a
// text are a prefix of the tokens of that text extended, wherever the first
// text ends at the end of a word (its last character is not whitespace) and
// the extension starts with whitespace. A conversation's next turn then
// extends the previous turn's tokens, and its prompt hits the prefix cache.
//
// A text is cut into words, each a run of whitespace followed by a run of
// non-whitespace (the first word's whitespace run may be empty, a trailing
// whitespace run is a word of its own), and each word into pieces of at most
// maxPieceBytes bytes on rune boundaries. A piece's id is a hash of its bytes
// in [firstTextToken, vocabSize). Four-byte pieces keep the counts close to
// the ceil(bytes/4) rule of thumb for English text.
//
// Chat messages are rendered through one fixed template, ChatML's:
//
//	<|im_start|>{role}\n{content}<|im_end|>\n   per message
//	<|im_start|>assistant\n                      with add_generation_prompt
//
// where <|im_start|> and <|im_end|> are special tokens with fixed ids and
// every other part is tokenized on its own, so that no part's tokens depend
// on its neighbours': a message's tokens are the same in every conversation
// it is part of.
const (
	vocabSize      = 50000
	tokenEOS       = 0 // what ends a generated answer; never in a text's tokens
	tokenBOS       = 1 // an empty text's only token: a prompt has at least one
	tokenIMStart   = 2
	tokenIMEnd     = 3
	firstTextToken = 4
	maxPieceBytes  = 4
)

// tokenizeText appends the tokens of s to dst.
func tokenizeText(dst []uint32, s string) []uint32 {
	forEachPiece(s, func(p string) { dst = append(dst, pieceID(p)) })
	return dst
}

// forEachPiece calls f with each piece of s, in order: s cut into words,
// each whitespace then non-whitespace, and each word into pieces of at most
// maxPieceBytes bytes, never inside a rune (an invalid byte counts as a
// rune of one byte).
func forEachPiece(s string, f func(piece string)) {
	for i := 0; i < len(s); {
		// One word: whitespace, then non-whitespace.
		j := i
		for j < len(s) {
			r, n := utf8.DecodeRuneInString(s[j:])
			if !unicode.IsSpace(r) {
				break
			}
			j += n
		}
		for j < len(s) {
			r, n := utf8.DecodeRuneInString(s[j:])
			if unicode.IsSpace(r) {
				break
			}
			j += n
		}
		for word := s[i:j]; len(word) > 0; {
			end := 0
			for end < len(word) {
				_, n := utf8.DecodeRuneInString(word[end:])
				if end > 0 && end+n > maxPieceBytes {
					break
				}
				end += n
			}
			f(word[:end])
			word = word[end:]
		}
		i = j
	}
}

func pieceID(piece string) uint32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(piece))
	return firstTextToken + h.Sum32()%(vocabSize-firstTextToken)
}

// promptTokens is the tokens of a text prompt: at least one.
func promptTokens(s string) []uint32 {
	t := tokenizeText(nil, s)
	if len(t) == 0 {
		t = append(t, tokenBOS)
	}
	return t
}

// chatMessage is one message of a chat, its content's text parts joined.
type chatMessage struct {
	role, content string
}

// chatTokens renders msgs through the template and tokenizes them.
func chatTokens(msgs []chatMessage, addGenerationPrompt bool) []uint32 {
	var t []uint32
	for _, m := range msgs {
		t = append(t, tokenIMStart)
		t = tokenizeText(t, m.role)
		t = tokenizeText(t, "\n")
		t = tokenizeText(t, m.content)
		t = append(t, tokenIMEnd)
		t = tokenizeText(t, "\n")
	}
	if addGenerationPrompt {
		t = append(t, tokenIMStart)
		t = tokenizeText(t, "assistant")
		t = tokenizeText(t, "\n")
	}
	return t
}

// Tokenize returns the sim's tokens of a text prompt, as POST /tokenize
// answers them and the engine counts them.
func Tokenize(text string) []uint32 { return promptTokens(text) }

// ChatMessage is a chat message for TokenizeChat: a role and its text.
type ChatMessage struct {
	Role, Content string
}

// TokenizeChat returns the sim's tokens of a chat, rendered through its
// template (add_generation_prompt as chat completions default to, true).
func TokenizeChat(msgs []ChatMessage, addGenerationPrompt bool) []uint32 {
	cm := make([]chatMessage, len(msgs))
	for i, m := range msgs {
		cm[i] = chatMessage{role: m.Role, content: m.Content}
	}
	return chatTokens(cm, addGenerationPrompt)
}

// tokenizer is what an engine tokenizes prompts with: the sim's own tokenizer above (the
// zero value), or a Hugging Face tokenizer.json (Config.Tokenizer), with which a prompt
// gets the tokens its post-processor adds (add_special_tokens, as vLLM's completions) and a
// chat is rendered through ChatML as one text and tokenized without them, as vLLM renders
// a model's template and tokenizes its output.
type tokenizer struct {
	hf *hftok.Tokenizer
}

func newTokenizer(file string) (tokenizer, error) {
	if file == "" {
		return tokenizer{}, nil
	}
	hf, err := hftok.LoadFile(file)
	if err != nil {
		return tokenizer{}, fmt.Errorf("sim: --tokenizer: %w", err)
	}
	if hf.VocabSize() > vocabSize {
		return tokenizer{}, fmt.Errorf("sim: --tokenizer %s: %d tokens, more than the sim's %d", file, hf.VocabSize(), vocabSize)
	}
	return tokenizer{hf: hf}, nil
}

func (t tokenizer) prompt(s string) ([]uint32, error) {
	if t.hf == nil {
		return promptTokens(s), nil
	}
	return t.encode(s, true)
}

func (t tokenizer) chat(msgs []chatMessage, addGenerationPrompt bool) ([]uint32, error) {
	if t.hf == nil {
		toks := chatTokens(msgs, addGenerationPrompt)
		if len(toks) == 0 {
			toks = append(toks, tokenBOS)
		}
		return toks, nil
	}
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n")
	}
	if addGenerationPrompt {
		b.WriteString("<|im_start|>assistant\n")
	}
	return t.encode(b.String(), false)
}

func (t tokenizer) encode(s string, addSpecialTokens bool) ([]uint32, error) {
	toks, err := t.hf.Encode(s, addSpecialTokens)
	if err != nil {
		return nil, badRequest("invalid_prompt", "tokenize: %v", err)
	}
	if len(toks) == 0 {
		return nil, badRequest("invalid_prompt", "the prompt has no tokens")
	}
	return toks, nil
}
