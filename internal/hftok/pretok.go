package hftok

import (
	"fmt"
	"unicode"
	"unicode/utf8"
	"unsafe"

	"github.com/dlclark/regexp2"
)

// A splitter is one pre-tokenizer step: it appends the pieces of s to dst.
type splitter interface {
	split(dst []string, s string) ([]string, error)
}

// A stepper is a splitter that also finds a text's pieces a few at a time, from its start,
// as split would find them: an encoding that stops at a number of tokens pre-tokenizes
// little past it, and holds the pieces of a few KiB of text at a time, not of the whole.
type stepper interface {
	splitter
	// step appends the pieces of a prefix of s (not empty) to dst, at least one, and
	// returns the prefix's length in bytes, text a Split removed included.
	step(dst []string, s string) ([]string, int, error)
}

// stepBytes is about how much text a stepper that matches by hand splits at a time.
const stepBytes = 4 << 10

// wholeWord is the ByteLevel pre-tokenizer without its prefix space and its regex: the text
// is one word.
type wholeWord struct{}

func (wholeWord) split(dst []string, s string) ([]string, error) { return append(dst, s), nil }

func (wholeWord) step(dst []string, s string) ([]string, int, error) {
	return append(dst, s), len(s), nil
}

// gpt2Split is the ByteLevel pre-tokenizer with its regex, use_regex (its other half, bytes
// mapped to characters, is the BPE's input, bpe.go): GPT-2's pattern.
type gpt2Split struct{}

func (gpt2Split) split(dst []string, s string) ([]string, error) { return splitGPT2(dst, s), nil }

func (gpt2Split) step(dst []string, s string) ([]string, int, error) {
	n := 0
	for n < len(s) && n < stepBytes {
		k := gpt2Match(s[n:])
		dst = append(dst, s[n:n+k])
		n += k
	}
	return dst, n, nil
}

// byteLevel is the ByteLevel pre-tokenizer with add_prefix_space: a leading space where s
// has none, then GPT-2's pattern when useRegex. It does not step: the space is s's alone.
type byteLevel struct {
	useRegex bool
}

func (b byteLevel) split(dst []string, s string) ([]string, error) {
	if s == "" || s[0] != ' ' {
		s = " " + s
	}
	if !b.useRegex {
		return append(dst, s), nil
	}
	return splitGPT2(dst, s), nil
}

// splitGPT2 appends the matches of GPT-2's pattern, which the ByteLevel pre-tokenizer
// applies with use_regex,
//
//	's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//
// matched by hand: its alternatives are tried in order at each position, as a backtracking
// engine tries them, and together they match every character, so the pieces cover s.
func splitGPT2(dst []string, s string) []string {
	for i := 0; i < len(s); {
		n := gpt2Match(s[i:])
		dst = append(dst, s[i:i+n])
		i += n
	}
	return dst
}

// gpt2Match is the length in bytes of GPT-2's pattern's match at the start of s (not empty).
func gpt2Match(s string) int {
	if s[0] == '\'' && len(s) > 1 {
		switch s[1] {
		case 's', 't', 'm', 'd':
			return 2
		case 'r', 'v':
			if len(s) > 2 && s[2] == 'e' {
				return 3
			}
		case 'l':
			if len(s) > 2 && s[2] == 'l' {
				return 3
			}
		}
	}
	// ` ?X+` for X letters, numbers, or neither nor whitespace: the space is taken only
	// when a run of X follows it.
	start := 0
	if s[0] == ' ' && len(s) > 1 {
		start = 1
	}
	for _, class := range []func(rune) bool{unicode.IsLetter, unicode.IsNumber, isOther} {
		for _, from := range []int{start, 0} {
			if n := runOf(s[from:], class); n > 0 {
				return from + n
			}
			if start == 0 {
				break
			}
		}
	}
	// \s+(?!\S) then \s+: a whitespace run, less its last character when a non-space
	// follows it and the run is longer than one.
	n, last := 0, 0
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		if !unicode.IsSpace(r) {
			break
		}
		n, last = n+w, w
	}
	if n == 0 {
		// Unreachable for valid classes (every rune is a letter, a number, whitespace or
		// other); one rune keeps the loop going whatever the input.
		_, w := utf8.DecodeRuneInString(s)
		return w
	}
	if n < len(s) && n > last {
		return n - last
	}
	return n
}

// isOther is [^\s\p{L}\p{N}].
func isOther(r rune) bool { return !unicode.IsSpace(r) && !unicode.IsLetter(r) && !unicode.IsNumber(r) }

// runOf is the length in bytes of the run of class at the start of s.
func runOf(s string, class func(rune) bool) int {
	n := 0
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		if !class(r) {
			break
		}
		n += w
	}
	return n
}

// regexSplit is the Split pre-tokenizer with a Regex pattern: the matches are pieces, and
// so are the gaps between them unless removed (behavior Removed).
type regexSplit struct {
	re     *regexp2.Regexp
	remove bool
}

func (p regexSplit) split(dst []string, s string) ([]string, error) {
	runes := []rune(s)
	// regexp2 indexes runes; off walks s's bytes alongside.
	pos, off := 0, 0
	bytesOf := func(from, to int) int {
		n := 0
		for _, r := range runes[from:to] {
			n += utf8.RuneLen(r)
		}
		return n
	}
	m, err := p.re.FindRunesMatch(runes)
	for ; err == nil && m != nil; m, err = p.re.FindNextMatch(m) {
		if m.Length == 0 {
			continue
		}
		if m.Index > pos {
			gap := bytesOf(pos, m.Index)
			if !p.remove {
				dst = append(dst, s[off:off+gap])
			}
			off += gap
		}
		n := bytesOf(m.Index, m.Index+m.Length)
		dst = append(dst, s[off:off+n])
		off += n
		pos = m.Index + m.Length
	}
	if err != nil {
		// Not regexp2's error, which quotes the whole text.
		return dst, fmt.Errorf("split pattern: a match timed out after %v, at byte %d of %d", p.re.MatchTimeout, off, len(s))
	}
	if off < len(s) && !p.remove {
		dst = append(dst, s[off:])
	}
	return dst, nil
}

// pipeline is a Sequence of splitters, each applied to every piece of the one before.
type pipeline []splitter

func (p pipeline) split(dst []string, s string) ([]string, error) {
	pieces := []string{s}
	for _, step := range p {
		var next []string
		for _, piece := range pieces {
			var err error
			if next, err = step.split(next, piece); err != nil {
				return dst, err
			}
		}
		pieces = next
	}
	return append(dst, pieces...), nil
}

// windowBytes is how much text a windowed splitter splits at a time.
const windowBytes = 16 << 10

// windowed steps a splitter (a Split's regex, a Sequence) a window of text at a time: it
// splits the first windowBytes of s and keeps the pieces before the last, which the
// window's end may have cut short, for the next window to split again. The pieces are
// split's of the whole text when each piece is decided by the text up to a character past
// it, as the pre-tokenizing patterns of served models are (runs of a class, \s+(?!\S), a
// Sequence of such); a window of one piece (a piece longer than the window) is cut where
// the window ends. Its pieces are slices of the text: no ByteLevel with add_prefix_space.
type windowed struct {
	splitter
}

func (w windowed) step(dst []string, s string) ([]string, int, error) {
	if len(s) <= windowBytes {
		dst, err := w.split(dst, s)
		return dst, len(s), err
	}
	cut := windowBytes
	for cut > windowBytes-utf8.UTFMax && !utf8.RuneStart(s[cut]) {
		cut--
	}
	n := len(dst)
	dst, err := w.split(dst, s[:cut])
	if err != nil || len(dst)-n < 2 {
		return dst, cut, err
	}
	last := dst[len(dst)-1]
	at := int(uintptr(unsafe.Pointer(unsafe.StringData(last))) - uintptr(unsafe.Pointer(unsafe.StringData(s))))
	if at <= 0 || at >= cut {
		return dst, cut, nil // not a slice of the window: none is, by windowable
	}
	return dst[:len(dst)-1], at, nil
}

// windowable reports whether sp's pieces are slices of the text it splits, as windowed
// needs: every splitter but a ByteLevel with add_prefix_space.
func windowable(sp splitter) bool {
	switch sp := sp.(type) {
	case byteLevel:
		return false
	case pipeline:
		for _, step := range sp {
			if !windowable(step) {
				return false
			}
		}
	}
	return true
}

// byteChars is GPT-2's map of bytes to characters: the printable ones of Latin-1 stand for
// themselves, the others for 256 and up, in order, so that every byte is a visible character
// and a BPE vocabulary of characters covers every byte string.
var byteChars = func() [256]string {
	var out [256]string
	next := 256
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			out[b] = string(rune(b))
			continue
		}
		out[b] = string(rune(next))
		next++
	}
	return out
}()
