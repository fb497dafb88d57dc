package hftok

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/nikolalohinski/gonja/v2"
	"github.com/nikolalohinski/gonja/v2/config"
	"github.com/nikolalohinski/gonja/v2/exec"
	"github.com/nikolalohinski/gonja/v2/loaders"
)

// maxTemplateBytes bounds a chat template file (a tokenizer_config.json included): the
// largest templates served are some tens of KiB.
const maxTemplateBytes = 4 << 20

// Template is a model's chat template, as transformers renders it: Jinja with trim_blocks
// and lstrip_blocks, messages, add_generation_prompt, bos_token, eos_token and
// raise_exception.
type Template struct {
	tpl      *exec.Template
	bos, eos string
}

// Message is one chat message as the template sees it: its role and its text.
type Message struct {
	Role, Content string
}

// LoadTemplate reads a chat template from path: a tokenizer_config.json (its chat_template,
// the one named "default" where it lists several, and its bos_token and eos_token), or
// any other file, taken as the template's Jinja source.
func LoadTemplate(path string) (*Template, error) {
	data, err := readBounded(path, maxTemplateBytes)
	if err != nil {
		return nil, err
	}
	src, bos, eos := string(data), "", ""
	if filepath.Ext(path) == ".json" {
		if src, bos, eos, err = fromTokenizerConfig(data); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	}
	t, err := ParseTemplate(src, bos, eos)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

func fromTokenizerConfig(data []byte) (src, bos, eos string, err error) {
	var c struct {
		ChatTemplate json.RawMessage `json:"chat_template"`
		BOS          json.RawMessage `json:"bos_token"`
		EOS          json.RawMessage `json:"eos_token"`
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return "", "", "", fmt.Errorf("not a tokenizer_config.json: %w", err)
	}
	if isNull(c.ChatTemplate) {
		return "", "", "", errors.New("no chat_template")
	}
	if json.Unmarshal(c.ChatTemplate, &src) != nil {
		var named []struct {
			Name     string `json:"name"`
			Template string `json:"template"`
		}
		if err := json.Unmarshal(c.ChatTemplate, &named); err != nil {
			return "", "", "", errors.New("chat_template is neither a string nor a list of named templates")
		}
		for _, n := range named {
			if n.Name == "default" {
				src = n.Template
			}
		}
		if src == "" {
			return "", "", "", errors.New("chat_template has no template named default")
		}
	}
	return src, specialText(c.BOS), specialText(c.EOS), nil
}

// specialText is a tokenizer_config.json's special token: a string or {"content": ...}.
func specialText(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var o struct {
		Content string `json:"content"`
	}
	_ = json.Unmarshal(raw, &o)
	return o.Content
}

// ParseTemplate parses a chat template's Jinja source; bos and eos are what bos_token and
// eos_token stand for in it.
func ParseTemplate(src, bos, eos string) (*Template, error) {
	if src == "" {
		return nil, errors.New("empty chat template")
	}
	cfg := config.New()
	cfg.TrimBlocks, cfg.LeftStripBlocks = true, true
	sum := sha256.Sum256([]byte(src))
	root := "chat-template-" + hex.EncodeToString(sum[:8])
	// A template renders from its own source only: the loader it may include from is
	// rooted nowhere the template names.
	base, err := loaders.NewMemoryLoader(nil)
	if err != nil {
		return nil, err
	}
	loader, err := loaders.NewShiftedLoader(root, bytes.NewReader([]byte(src)), base)
	if err != nil {
		return nil, err
	}
	tpl, err := exec.NewTemplate(root, cfg, loader, gonja.DefaultEnvironment)
	if err != nil {
		return nil, fmt.Errorf("chat template: %w", err)
	}
	return &Template{tpl: tpl, bos: bos, eos: eos}, nil
}

// Render renders msgs, with the assistant's turn opened when addGenerationPrompt. The
// messages are a client's: a template engine that panics on them answers an error.
func (t *Template) Render(msgs []Message, addGenerationPrompt bool) (out string, err error) {
	defer func() {
		if p := recover(); p != nil {
			out, err = "", fmt.Errorf("chat template: %v", p)
		}
	}()
	list := make([]map[string]any, len(msgs))
	for i, m := range msgs {
		list[i] = map[string]any{"role": m.Role, "content": m.Content}
	}
	ctx := exec.NewContext(map[string]any{
		"messages":              list,
		"add_generation_prompt": addGenerationPrompt,
		"bos_token":             t.bos,
		"eos_token":             t.eos,
		"raise_exception":       func(msg string) (string, error) { return "", errors.New(msg) },
	})
	// The text is about the messages' length: a buffer of that size at once spares the
	// copies of one grown by doubling, and the copy into a string at the end.
	var b strings.Builder
	size := 256
	for _, m := range msgs {
		size += len(m.Role) + len(m.Content) + 64
	}
	b.Grow(size)
	if err = t.tpl.Execute(&b, ctx); err != nil {
		return "", fmt.Errorf("chat template: %w", err)
	}
	return b.String(), nil
}
