package hftok

import (
	"fmt"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
)

// A splitter is one pre-tokenizer step: it appends the pieces of s to dst.
type splitter interface {
	split(dst []string, s string) ([]string, error)
}

// byteLevel is the ByteLevel pre-tokenizer's splitting half (its other half, bytes mapped
// to characters, is the BPE's input, bpe.go): an optional leading space, then GPT-2's pattern
// when useRegex.
type byteLevel struct {
	addPrefixSpace bool
	useRegex       bool
}

func (b byteLevel) split(dst []string, s string) ([]string, error) {
	if b.addPrefixSpace && (s == "" || s[0] != ' ') {
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
		return dst, fmt.Errorf("split pattern: %w", err)
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
