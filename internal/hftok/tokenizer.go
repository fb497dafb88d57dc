package hftok

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
	"golang.org/x/text/unicode/norm"
)

// MaxFileBytes bounds a tokenizer.json: the largest vocabularies served (about 250k tokens)
// take some tens of MiB.
const MaxFileBytes = 256 << 20

// splitMatchTimeout bounds one match of a Split pattern that no hand-written matcher stands
// in for; a sound pattern matches a piece in microseconds.
const splitMatchTimeout = 100 * time.Millisecond

// Tokenizer is a tokenizer.json's tokenizer.
type Tokenizer struct {
	model      *bpe
	normalize  func(string) string // nil: none
	pre        splitter
	added      [256][]addedToken // by first byte, the longest first
	prefix     []uint32          // what TemplateProcessing puts before a prompt
	suffix     []uint32          // and after it
	vocabSize  int
	specialIDs map[string]uint32
	segments   *tokenCache
	scratch    sync.Pool // of *encodeScratch
}

type addedToken struct {
	content string
	id      uint32
}

// LoadFile reads a tokenizer.json.
func LoadFile(path string) (*Tokenizer, error) {
	data, err := readBounded(path, MaxFileBytes)
	if err != nil {
		return nil, err
	}
	t, err := Load(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

func readBounded(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() > limit {
		return nil, fmt.Errorf("%s: %d bytes, more than the %d a tokenizer file may have", path, st.Size(), limit)
	}
	var b bytes.Buffer
	if _, err := b.ReadFrom(f); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return b.Bytes(), nil
}

// fileJSON is what Load reads of a tokenizer.json; the components stay raw until their
// type is known.
type fileJSON struct {
	AddedTokens []struct {
		ID         *int64 `json:"id"`
		Content    string `json:"content"`
		SingleWord bool   `json:"single_word"`
		LStrip     bool   `json:"lstrip"`
		RStrip     bool   `json:"rstrip"`
		Normalized bool   `json:"normalized"`
		Special    bool   `json:"special"`
	} `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Model         *struct {
		Type                    string            `json:"type"`
		Dropout                 *float64          `json:"dropout"`
		UnkToken                *string           `json:"unk_token"`
		ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
		EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
		ByteFallback            bool              `json:"byte_fallback"`
		IgnoreMerges            bool              `json:"ignore_merges"`
		Vocab                   map[string]int64  `json:"vocab"`
		Merges                  []json.RawMessage `json:"merges"`
	} `json:"model"`
}

// typed is any component's type tag.
type typed struct {
	Type string `json:"type"`
}

// Load builds a Tokenizer from a tokenizer.json's bytes, or says which part of it this
// package does not reproduce.
func Load(data []byte) (*Tokenizer, error) {
	var f fileJSON
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("not a tokenizer.json: %w", err)
	}
	if f.Model == nil {
		return nil, errors.New("no model")
	}
	m := f.Model
	if m.Type != "BPE" && !(m.Type == "" && m.Merges != nil) {
		return nil, fmt.Errorf("model %q: only BPE is supported", m.Type)
	}
	switch {
	case m.Dropout != nil && *m.Dropout != 0:
		return nil, errors.New("model: BPE dropout is not supported (its tokens are random)")
	case m.ByteFallback:
		return nil, errors.New("model: byte_fallback (SentencePiece-style BPE) is not supported, only byte-level BPE")
	case m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "",
		m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "":
		return nil, errors.New("model: continuing_subword_prefix and end_of_word_suffix are not supported")
	case len(m.Vocab) == 0:
		return nil, errors.New("model: empty vocab")
	}
	t := &Tokenizer{specialIDs: map[string]uint32{}, segments: newTokenCache(segmentCacheSlots, segmentCacheBudget)}
	t.scratch.New = func() any { return new(encodeScratch) }
	model := &bpe{vocab: make(map[string]uint32, len(m.Vocab)), merges: make(map[uint64]merge, len(m.Merges)),
		ignoreMerges: m.IgnoreMerges, cache: newTokenCache(wordCacheSlots, 0)}
	for tok, id := range m.Vocab {
		if id < 0 || id > 1<<31 {
			return nil, fmt.Errorf("model: token %q has id %d", tok, id)
		}
		model.vocab[tok] = uint32(id)
		model.maxTokenLen = max(model.maxTokenLen, utf8.RuneCountInString(tok))
		t.vocabSize = max(t.vocabSize, int(id)+1)
	}
	for b, c := range byteChars {
		id, ok := model.vocab[c]
		if !ok {
			return nil, fmt.Errorf("model: byte 0x%02x (%q) is not in the vocab: not a byte-level BPE", b, c)
		}
		model.byteIDs[b] = id
	}
	for i, raw := range m.Merges {
		a, b, err := mergePair(raw)
		if err != nil {
			return nil, fmt.Errorf("model: merges[%d]: %w", i, err)
		}
		ia, oka := model.vocab[a]
		ib, okb := model.vocab[b]
		id, ok := model.vocab[a+b]
		if !oka || !okb || !ok {
			return nil, fmt.Errorf("model: merges[%d] %q %q: a part or the merge is not in the vocab", i, a, b)
		}
		if _, dup := model.merges[pairKey(ia, ib)]; !dup {
			model.merges[pairKey(ia, ib)] = merge{rank: int32(i), id: id}
		}
	}
	t.model = model

	var err error
	if t.normalize, err = normalizer(f.Normalizer); err != nil {
		return nil, fmt.Errorf("normalizer: %w", err)
	}
	var sawByteLevel bool
	if t.pre, err = preTokenizer(f.PreTokenizer, &sawByteLevel); err != nil {
		return nil, fmt.Errorf("pre_tokenizer: %w", err)
	}
	if !sawByteLevel {
		return nil, errors.New("pre_tokenizer: no ByteLevel step: not a byte-level BPE")
	}
	if _, ok := t.pre.(stepper); !ok && windowable(t.pre) {
		t.pre = windowed{t.pre}
	}
	for i, a := range f.AddedTokens {
		switch {
		case a.ID == nil || *a.ID < 0 || *a.ID > 1<<31:
			return nil, fmt.Errorf("added_tokens[%d] %q: no valid id", i, a.Content)
		case a.Content == "":
			return nil, fmt.Errorf("added_tokens[%d]: empty content", i)
		case a.SingleWord || a.LStrip || a.RStrip:
			return nil, fmt.Errorf("added_tokens[%d] %q: single_word, lstrip and rstrip are not supported", i, a.Content)
		case a.Normalized && t.normalize != nil:
			return nil, fmt.Errorf("added_tokens[%d] %q: a normalized added token under a normalizer is not supported", i, a.Content)
		}
		id := uint32(*a.ID)
		t.added[a.Content[0]] = append(t.added[a.Content[0]], addedToken{content: a.Content, id: id})
		t.vocabSize = max(t.vocabSize, int(id)+1)
		if a.Special {
			t.specialIDs[a.Content] = id
		}
	}
	for _, list := range &t.added {
		slices.SortStableFunc(list, func(x, y addedToken) int { return len(y.content) - len(x.content) })
	}
	if t.prefix, t.suffix, err = postProcessor(f.PostProcessor); err != nil {
		return nil, fmt.Errorf("post_processor: %w", err)
	}
	return t, nil
}

// mergePair reads a merge in either spelling: "a b" or ["a", "b"].
func mergePair(raw json.RawMessage) (string, string, error) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		a, b, ok := strings.Cut(s, " ")
		if !ok || a == "" || b == "" || strings.Contains(b, " ") {
			return "", "", fmt.Errorf("%q is not two tokens split by a space", s)
		}
		return a, b, nil
	}
	var p []string
	if err := json.Unmarshal(raw, &p); err != nil || len(p) != 2 || p[0] == "" || p[1] == "" {
		return "", "", fmt.Errorf("%s is neither \"a b\" nor [\"a\", \"b\"]", raw)
	}
	return p[0], p[1], nil
}

func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || bytes.Equal(raw, []byte("null"))
}

func normalizer(raw json.RawMessage) (func(string) string, error) {
	if isNull(raw) {
		return nil, nil
	}
	var n struct {
		typed
		Normalizers []json.RawMessage `json:"normalizers"`
	}
	if err := json.Unmarshal(raw, &n); err != nil {
		return nil, err
	}
	switch n.Type {
	case "NFC":
		return norm.NFC.String, nil
	case "NFD":
		return norm.NFD.String, nil
	case "NFKC":
		return norm.NFKC.String, nil
	case "NFKD":
		return norm.NFKD.String, nil
	case "Lowercase":
		return strings.ToLower, nil
	case "Sequence":
		var steps []func(string) string
		for i, r := range n.Normalizers {
			f, err := normalizer(r)
			if err != nil {
				return nil, fmt.Errorf("normalizers[%d]: %w", i, err)
			}
			if f != nil {
				steps = append(steps, f)
			}
		}
		if len(steps) == 0 {
			return nil, nil
		}
		return func(s string) string {
			for _, f := range steps {
				s = f(s)
			}
			return s
		}, nil
	}
	return nil, fmt.Errorf("type %q is not supported", n.Type)
}

func preTokenizer(raw json.RawMessage, sawByteLevel *bool) (splitter, error) {
	if isNull(raw) {
		return nil, errors.New("none: a byte-level BPE has a ByteLevel pre-tokenizer")
	}
	var p struct {
		typed
		AddPrefixSpace bool              `json:"add_prefix_space"`
		UseRegex       *bool             `json:"use_regex"`
		Pretokenizers  []json.RawMessage `json:"pretokenizers"`
		Pattern        struct {
			Regex  *string `json:"Regex"`
			String *string `json:"String"`
		} `json:"pattern"`
		Behavior string `json:"behavior"`
		Invert   bool   `json:"invert"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, err
	}
	switch p.Type {
	case "ByteLevel":
		*sawByteLevel = true
		// use_regex is true when absent, as in files written before it existed.
		useRegex := p.UseRegex == nil || *p.UseRegex
		switch {
		case p.AddPrefixSpace:
			return byteLevel{useRegex: useRegex}, nil
		case useRegex:
			return gpt2Split{}, nil
		}
		return wholeWord{}, nil
	case "Split":
		if p.Invert {
			return nil, fmt.Errorf("type %q: invert is not supported", p.Type)
		}
		var expr string
		switch {
		case p.Pattern.Regex != nil:
			expr = *p.Pattern.Regex
		case p.Pattern.String != nil:
			expr = regexp2.Escape(*p.Pattern.String)
		default:
			return nil, fmt.Errorf("type %q: no pattern", p.Type)
		}
		if expr == "" {
			return nil, fmt.Errorf("type %q: empty pattern", p.Type)
		}
		re, err := regexp2.Compile(expr, regexp2.Unicode)
		if err != nil {
			return nil, fmt.Errorf("type %q: pattern %q: %w", p.Type, expr, err)
		}
		// regexp2 backtracks: a pattern that does so badly on a client's text must fail that
		// text (its caller then asks an engine), not hold a request for as long as it takes.
		re.MatchTimeout = splitMatchTimeout
		switch p.Behavior {
		case "Isolated":
			switch expr {
			case llama3Pattern:
				return llama3Split{maxDigits: 3}, nil
			case qwen2Pattern:
				return llama3Split{maxDigits: 1}, nil
			}
			return regexSplit{re: re}, nil
		case "Removed":
			return regexSplit{re: re, remove: true}, nil
		}
		return nil, fmt.Errorf("type %q: behavior %q is not supported (Isolated and Removed are)", p.Type, p.Behavior)
	case "Sequence":
		var steps pipeline
		for i, r := range p.Pretokenizers {
			s, err := preTokenizer(r, sawByteLevel)
			if err != nil {
				return nil, fmt.Errorf("pretokenizers[%d]: %w", i, err)
			}
			if s != (wholeWord{}) { // a ByteLevel without prefix space or regex splits nothing
				steps = append(steps, s)
			}
		}
		if len(steps) == 0 {
			return wholeWord{}, nil
		}
		if len(steps) == 1 {
			return steps[0], nil
		}
		return steps, nil
	}
	return nil, fmt.Errorf("type %q is not supported", p.Type)
}

// postProcessor returns the tokens a TemplateProcessing puts around a single sequence.
func postProcessor(raw json.RawMessage) (prefix, suffix []uint32, err error) {
	if isNull(raw) {
		return nil, nil, nil
	}
	var p struct {
		typed
		Processors []json.RawMessage `json:"processors"`
		Single     []struct {
			SpecialToken *struct {
				ID string `json:"id"`
			} `json:"SpecialToken"`
			Sequence *struct {
				ID string `json:"id"`
			} `json:"Sequence"`
		} `json:"single"`
		SpecialTokens map[string]struct {
			IDs []uint32 `json:"ids"`
		} `json:"special_tokens"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, nil, err
	}
	switch p.Type {
	case "ByteLevel":
		return nil, nil, nil // offsets only
	case "Sequence":
		for i, r := range p.Processors {
			pre, suf, err := postProcessor(r)
			if err != nil {
				return nil, nil, fmt.Errorf("processors[%d]: %w", i, err)
			}
			if len(pre)+len(suf) > 0 {
				if len(prefix)+len(suffix) > 0 {
					return nil, nil, errors.New("two processors add tokens")
				}
				prefix, suffix = pre, suf
			}
		}
		return prefix, suffix, nil
	case "TemplateProcessing":
		seen := false
		for i, piece := range p.Single {
			switch {
			case piece.Sequence != nil:
				if seen || piece.Sequence.ID != "A" {
					return nil, nil, fmt.Errorf("single[%d]: one sequence A only", i)
				}
				seen = true
			case piece.SpecialToken != nil:
				st, ok := p.SpecialTokens[piece.SpecialToken.ID]
				if !ok {
					return nil, nil, fmt.Errorf("single[%d]: %q is not in special_tokens", i, piece.SpecialToken.ID)
				}
				if seen {
					suffix = append(suffix, st.IDs...)
				} else {
					prefix = append(prefix, st.IDs...)
				}
			default:
				return nil, nil, fmt.Errorf("single[%d]: neither SpecialToken nor Sequence", i)
			}
		}
		if !seen {
			return nil, nil, errors.New("single: no sequence A")
		}
		return prefix, suffix, nil
	}
	return nil, nil, fmt.Errorf("type %q is not supported", p.Type)
}

// VocabSize is one more than the largest token id the tokenizer can produce.
func (t *Tokenizer) VocabSize() int { return t.vocabSize }

// Encode returns text's tokens: added tokens where they occur, the rest normalized,
// pre-tokenized and merged; with addSpecialTokens, the post-processor's tokens around them
// (a completion's prompt has them, vLLM's chat rendering does not add them on top of its
// template's).
func (t *Tokenizer) Encode(text string, addSpecialTokens bool) ([]uint32, error) {
	s := t.scratch.Get().(*encodeScratch)
	defer t.putScratch(s)
	out, err := t.appendEncode(s, s.ids[:0], text, addSpecialTokens, math.MaxInt)
	s.ids = out[:0]
	if err != nil {
		return nil, err
	}
	// Never nil, even empty: the tokens go out as JSON, where nil is null.
	return append(make([]uint32, 0, len(out)), out...), nil
}

// AppendEncode appends text's tokens, as Encode returns them, to dst: a caller that encodes
// often can hand the same buffer back each time, and allocate nothing for the tokens.
func (t *Tokenizer) AppendEncode(dst []uint32, text string, addSpecialTokens bool) ([]uint32, error) {
	s := t.scratch.Get().(*encodeScratch)
	defer t.putScratch(s)
	return t.appendEncode(s, dst, text, addSpecialTokens, math.MaxInt)
}

// AppendEncodeMax is AppendEncode for at most limit tokens: it stops tokenizing text once
// it has more than limit, and then appends the first limit and reports false. So a caller
// that needs no more than the first limit (a router that matches prompts no engine takes
// longer) spends on a long text about what it spends on one of limit tokens, in time and in
// memory, however long the text and its words.
func (t *Tokenizer) AppendEncodeMax(dst []uint32, text string, addSpecialTokens bool, limit int) ([]uint32, bool, error) {
	s := t.scratch.Get().(*encodeScratch)
	defer t.putScratch(s)
	stop := math.MaxInt
	if limit < math.MaxInt/2 {
		stop = len(dst) + max(limit, 0) + 1
	}
	out, err := t.appendEncode(s, dst, text, addSpecialTokens, stop)
	if err != nil {
		return out, false, err
	}
	if len(out) >= stop {
		return out[:stop-1], false, nil
	}
	return out, true, nil
}

// appendEncode appends text's tokens to out, stopping once out holds stop tokens or more:
// the tokens past stop are the caller's to drop.
func (t *Tokenizer) appendEncode(s *encodeScratch, out []uint32, text string, addSpecialTokens bool, stop int) ([]uint32, error) {
	if addSpecialTokens {
		out = append(out, t.prefix...)
	}
	start := 0
	flush := func(end int) error {
		if end <= start || len(out) >= stop {
			return nil
		}
		seg := text[start:end]
		cacheable := len(seg) >= minCachedSegmentBytes && len(seg) <= maxCachedSegmentBytes
		var h uint64
		if cacheable {
			h = t.segments.hash(seg)
			if ids, ok := t.segments.get(h, seg); ok {
				out = append(out, ids...)
				return nil
			}
		}
		n := len(out)
		var whole bool
		var err error
		if out, whole, err = t.encodeSegment(s, out, seg, stop); err != nil {
			return err
		}
		if cacheable && whole {
			t.segments.put(h, seg, out[n:])
		}
		return nil
	}
	for i := 0; i < len(text) && len(out) < stop; {
		if list := t.added[text[i]]; list != nil {
			if a, ok := matchAdded(list, text[i:]); ok {
				if err := flush(i); err != nil {
					return out, err
				}
				out = append(out, a.id)
				i += len(a.content)
				start = i
				continue
			}
		}
		i++
	}
	if err := flush(len(text)); err != nil {
		return out, err
	}
	if addSpecialTokens && len(out) < stop {
		out = append(out, t.suffix...)
	}
	return out, nil
}

// encodeSegment appends the tokens of seg, text without added tokens, to out, stopping
// once out holds stop tokens or more; whole reports that it did not stop.
func (t *Tokenizer) encodeSegment(s *encodeScratch, out []uint32, seg string, stop int) (_ []uint32, whole bool, err error) {
	words := seg
	if t.normalize != nil {
		words = t.normalize(seg) // seg itself when already normal: NFC is most text's form
	}
	st, steps := t.pre.(stepper)
	if !steps {
		if s.pieces, err = t.pre.split(s.pieces[:0], words); err != nil {
			return out, false, err
		}
		out, whole = t.encodePieces(s, out, s.pieces, stop)
		return out, whole, nil
	}
	for len(words) > 0 {
		var n int
		if s.pieces, n, err = st.step(s.pieces[:0], words); err != nil {
			return out, false, err
		}
		if out, whole = t.encodePieces(s, out, s.pieces, stop); !whole {
			return out, false, nil
		}
		words = words[n:]
	}
	return out, true, nil
}

// encodePieces appends the tokens of pieces to out, stopping once out holds stop tokens or
// more; whole reports that it did not stop.
func (t *Tokenizer) encodePieces(s *encodeScratch, out []uint32, pieces []string, stop int) (_ []uint32, whole bool) {
	for _, p := range pieces {
		if len(out) >= stop {
			return out, false
		}
		if p != "" {
			out = t.model.encode(out, p, &s.merge, stop)
		}
	}
	return out, len(out) < stop
}

// encodeScratch is what an encoding works in; a Tokenizer keeps some between encodings,
// so that one allocates little more than the tokens it returns.
type encodeScratch struct {
	pieces []string
	ids    []uint32
	merge  mergeScratch
}

// maxKeptScratch bounds each buffer of the scratch a Tokenizer keeps after an encoding, in
// elements: a rare huge prompt's is left to the collector. The merge's hold a chunk of a word
// at most (mergeChunkBytes), and the pieces a step's (stepBytes, windowBytes) when the
// pre-tokenizer steps.
const maxKeptScratch = 1 << 16

func (t *Tokenizer) putScratch(s *encodeScratch) {
	m := &s.merge
	if max(cap(s.ids), cap(s.pieces), cap(m.ids), cap(m.next), cap(m.prev), cap(m.heap), cap(m.made), cap(m.mapped)) > maxKeptScratch {
		return
	}
	clear(s.pieces[:cap(s.pieces)]) // they are slices of a caller's text
	t.scratch.Put(s)
}

func matchAdded(list []addedToken, s string) (addedToken, bool) {
	for _, a := range list {
		if strings.HasPrefix(s, a.content) {
			return a, true
		}
	}
	return addedToken{}, false
}

// SpecialToken returns the id of a special added token.
func (t *Tokenizer) SpecialToken(content string) (uint32, bool) {
	id, ok := t.specialIDs[content]
	return id, ok
}
