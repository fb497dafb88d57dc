package hftok

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/nikolalohinski/gonja/v2"
	controlstructures "github.com/nikolalohinski/gonja/v2/builtins/control_structures"
	"github.com/nikolalohinski/gonja/v2/config"
	"github.com/nikolalohinski/gonja/v2/exec"
	"github.com/nikolalohinski/gonja/v2/loaders"
	"github.com/nikolalohinski/gonja/v2/nodes"
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
	return parseTemplate(src, bos, eos, true)
}

// parseTemplate is ParseTemplate; split says whether sums of strings are written term by
// term (splitConcatenations), which only a test turns off, to compare.
func parseTemplate(src, bos, eos string, split bool) (*Template, error) {
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
	if split {
		splitConcatenations(tpl.Root())
	}
	return &Template{tpl: tpl, bos: bos, eos: eos}, nil
}

// Render renders msgs, with the assistant's turn opened when addGenerationPrompt. The
// messages are a client's: a template engine that panics on them answers an error.
func (t *Template) Render(msgs []Message, addGenerationPrompt bool) (string, error) {
	// The text is about the messages' length: a buffer of that size at once spares the
	// copies of one grown by doubling, and the copy into a string at the end.
	var b strings.Builder
	b.Grow(renderSize(msgs))
	if err := t.execute(&b, msgs, addGenerationPrompt); err != nil {
		return "", err
	}
	return b.String(), nil
}

// AppendRender appends what Render returns to dst: a caller that renders often can hand the
// same buffer back each time.
func (t *Template) AppendRender(dst []byte, msgs []Message, addGenerationPrompt bool) ([]byte, error) {
	b := bytes.NewBuffer(dst)
	b.Grow(renderSize(msgs))
	err := t.execute(b, msgs, addGenerationPrompt)
	return b.Bytes(), err
}

// renderSize is about the length of msgs rendered.
func renderSize(msgs []Message) int {
	size := 256
	for _, m := range msgs {
		size += len(m.Role) + len(m.Content) + 64
	}
	return size
}

func (t *Template) execute(w io.Writer, msgs []Message, addGenerationPrompt bool) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("chat template: %v", p)
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
	if err = t.tpl.Execute(w, ctx); err != nil {
		return fmt.Errorf("chat template: %w", err)
	}
	return nil
}

// splitConcatenations rewrites each {{ a + b + c }} of a template whose terms include a
// string literal into {{ a }}{{ b }}{{ c }}: the same text, without the template engine
// copying each partial sum (a chat template's {{ '<|im_start|>' + role + '\n' + content +
// '<|im_end|>' + '\n' }} copied every message three times). With a string literal among
// them, Jinja renders the sum only when every term is a string (it refuses to add a string to
// anything else), and the sum of strings is what writing them one after another writes.
// Conditional outputs ({{ a if c else b }}) and sums without a literal are left whole; so
// is anything outside the template's top level, its for and if blocks and its macros.
func splitConcatenations(t *nodes.Template) {
	t.Nodes = splitIn(t.Nodes)
	for _, m := range t.Macros {
		splitWrapper(m.Wrapper)
	}
}

func splitWrapper(w *nodes.Wrapper) {
	if w != nil {
		w.Nodes = splitIn(w.Nodes)
	}
}

func splitIn(ns []nodes.Node) []nodes.Node {
	out := ns[:0:0]
	for _, n := range ns {
		switch n := n.(type) {
		case *nodes.Output:
			if terms := stringSum(n); terms != nil {
				for _, e := range terms {
					out = append(out, &nodes.Output{Start: n.Start, Expression: e, End: n.End})
				}
				continue
			}
		case *nodes.ControlStructureBlock:
			switch cs := n.ControlStructure.(type) {
			case *controlstructures.ForControlStructure:
				splitWrapper(cs.BodyWrapper)
				splitWrapper(cs.EmptyWrapper)
			case *controlstructures.IfControlStructure:
				for _, w := range cs.Wrappers {
					splitWrapper(w)
				}
			}
		}
		out = append(out, n)
	}
	return out
}

// stringSum returns the terms of an unconditional output that is a sum with a string literal
// among its terms, nil for any other.
func stringSum(o *nodes.Output) []nodes.Expression {
	if o.Condition != nil {
		return nil
	}
	var terms []nodes.Expression
	var add func(e nodes.Expression)
	add = func(e nodes.Expression) {
		if b, ok := e.(*nodes.BinaryExpression); ok && b.Operator != nil && b.Operator.Token != nil && b.Operator.Token.Val == "+" {
			add(b.Left)
			add(b.Right)
			return
		}
		terms = append(terms, e)
	}
	add(o.Expression)
	for _, e := range terms {
		if _, ok := e.(*nodes.String); ok && len(terms) > 1 {
			return terms
		}
	}
	return nil
}
