package hftok

import (
	"unicode"
	"unicode/utf8"
)

// The Split patterns of Llama 3's tokenizer.json and of Qwen 2's (which takes one digit at a
// time), matched by hand as splitGPT2 matches GPT-2's: a backtracking engine spends most of
// a prompt's tokenizing on them.
const (
	llama3Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	qwen2Pattern  = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// llama3Split is the Split pre-tokenizer (Isolated) of llama3Pattern, or qwen2Pattern with
// maxDigits 1.
type llama3Split struct {
	maxDigits int
}

func (p llama3Split) split(dst []string, s string) ([]string, error) {
	for i := 0; i < len(s); {
		n := p.match(s[i:])
		dst = append(dst, s[i:i+n])
		i += n
	}
	return dst, nil
}

func (p llama3Split) step(dst []string, s string) ([]string, int, error) {
	n := 0
	for n < len(s) && n < stepBytes {
		k := p.match(s[n:])
		dst = append(dst, s[n:n+k])
		n += k
	}
	return dst, n, nil
}

func isCRLF(r rune) bool { return r == '\r' || r == '\n' }

// match is the length in bytes of the pattern's match at the start of s (not empty): its
// alternatives in order, as a backtracking engine tries them.
func (p llama3Split) match(s string) int {
	r0, w0 := utf8.DecodeRuneInString(s)
	// (?i:'s|'t|'re|'ve|'m|'ll|'d)
	if r0 == '\'' && len(s) > 1 {
		switch s[1] | 0x20 {
		case 's', 't', 'm', 'd':
			return 2
		case 'r', 'v':
			if len(s) > 2 && s[2]|0x20 == 'e' {
				return 3
			}
		case 'l':
			if len(s) > 2 && s[2]|0x20 == 'l' {
				return 3
			}
		}
	}
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if !isCRLF(r0) && !unicode.IsLetter(r0) && !unicode.IsNumber(r0) {
		if n := runOf(s[w0:], unicode.IsLetter); n > 0 {
			return w0 + n
		}
	}
	if n := runOf(s, unicode.IsLetter); n > 0 {
		return n
	}
	// \p{N}{1,maxDigits}
	if unicode.IsNumber(r0) {
		n := 0
		for k := 0; k < p.maxDigits && n < len(s); k++ {
			r, w := utf8.DecodeRuneInString(s[n:])
			if !unicode.IsNumber(r) {
				break
			}
			n += w
		}
		return n
	}
	// ` ?[^\s\p{L}\p{N}]+[\r\n]*`
	for _, from := range []int{1, 0} {
		if from == 1 && r0 != ' ' {
			continue
		}
		if n := runOf(s[from:], isOther); n > 0 {
			n += from
			return n + runOf(s[n:], isCRLF)
		}
	}
	// The whitespace run, and where its last \r or \n ends.
	n, last, lastBreak := 0, 0, -1
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		if !unicode.IsSpace(r) {
			break
		}
		n, last = n+w, w
		if isCRLF(r) {
			lastBreak = n
		}
	}
	switch {
	case n == 0:
		return w0 // not reached: every rune is a letter, a number, whitespace or other
	case lastBreak > 0: // \s*[\r\n]+
		return lastBreak
	case n < len(s) && n > last: // \s+(?!\S)
		return n - last
	}
	return n // \s+
}
