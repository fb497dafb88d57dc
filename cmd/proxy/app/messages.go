package app

import (
	"strings"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/pdproxy/pdproxy/internal/hftok"
)

// plainMessages reads messages that are a role and a string content each, which a template
// sees as the engine does. Anything more (content parts, which engines join by their own
// rules; tool calls; names) is left to the engine, and so is anything it does not read the
// one way every JSON reader would: a key spelled otherwise than "role" and "content", a key
// given twice, invalid UTF-8 or a lone surrogate in a string.
//
// It reads the array itself, allocating only the strings: encoding/json's Decoder, which
// refusing unknown fields needs, copied the whole array into a growing buffer first and made
// most of the tail of a request's tokenizing.
func plainMessages(raw []byte) ([]hftok.Message, bool) {
	r := msgReader{b: raw}
	r.space()
	if !r.eat('[') {
		return nil, false
	}
	out := make([]hftok.Message, 0, 8)
	for {
		r.space()
		m, ok := r.message()
		if !ok {
			return nil, false
		}
		out = append(out, m)
		r.space()
		if r.eat(',') {
			continue
		}
		if !r.eat(']') {
			return nil, false
		}
		r.space()
		if r.i != len(r.b) {
			return nil, false
		}
		return out, true
	}
}

// msgReader reads JSON from b, at i.
type msgReader struct {
	b []byte
	i int
}

func (r *msgReader) space() {
	for r.i < len(r.b) {
		switch r.b[r.i] {
		case ' ', '\t', '\n', '\r':
			r.i++
		default:
			return
		}
	}
}

func (r *msgReader) eat(c byte) bool {
	if r.i < len(r.b) && r.b[r.i] == c {
		r.i++
		return true
	}
	return false
}

// message reads {"role": string, "content": string}, both present, in either order, the role
// not empty.
func (r *msgReader) message() (m hftok.Message, ok bool) {
	if !r.eat('{') {
		return m, false
	}
	var role, content bool
	for {
		r.space()
		key, ok := r.str()
		if !ok {
			return m, false
		}
		r.space()
		if !r.eat(':') {
			return m, false
		}
		r.space()
		val, ok := r.str()
		if !ok {
			return m, false
		}
		switch {
		case key == "role" && !role:
			m.Role, role = val, true
		case key == "content" && !content:
			m.Content, content = val, true
		default:
			return m, false
		}
		r.space()
		if r.eat(',') {
			continue
		}
		if !r.eat('}') {
			return m, false
		}
		return m, role && content && m.Role != ""
	}
}

// str reads a string: its bytes at once when it has no escape, else unescaped one by one.
func (r *msgReader) str() (string, bool) {
	if !r.eat('"') {
		return "", false
	}
	start := r.i
	for j := start; j < len(r.b); j++ {
		switch c := r.b[j]; {
		case c == '"':
			s := r.b[start:j]
			if !utf8.Valid(s) {
				return "", false
			}
			r.i = j + 1
			return string(s), true
		case c == '\\':
			return r.escaped(start, j)
		case c < 0x20:
			return "", false
		}
	}
	return "", false
}

// escaped reads the rest of a string that started at start and has its first escape at j.
func (r *msgReader) escaped(start, j int) (string, bool) {
	var sb strings.Builder
	sb.Grow(len(r.b) - start)
	sb.Write(r.b[start:j])
	for j < len(r.b) {
		c := r.b[j]
		switch {
		case c == '"':
			if !utf8.ValidString(sb.String()) {
				return "", false
			}
			r.i = j + 1
			return sb.String(), true
		case c < 0x20:
			return "", false
		case c != '\\':
			sb.WriteByte(c)
			j++
			continue
		}
		if j+1 >= len(r.b) {
			return "", false
		}
		j += 2
		switch r.b[j-1] {
		case '"', '\\', '/':
			sb.WriteByte(r.b[j-1])
		case 'b':
			sb.WriteByte('\b')
		case 'f':
			sb.WriteByte('\f')
		case 'n':
			sb.WriteByte('\n')
		case 'r':
			sb.WriteByte('\r')
		case 't':
			sb.WriteByte('\t')
		case 'u':
			u, ok := hex4(r.b, j)
			if !ok {
				return "", false
			}
			j += 4
			if utf16.IsSurrogate(rune(u)) {
				// Only a high surrogate followed by an escaped low one is a character.
				if u >= 0xdc00 || j+6 > len(r.b) || r.b[j] != '\\' || r.b[j+1] != 'u' {
					return "", false
				}
				lo, ok := hex4(r.b, j+2)
				if !ok || lo < 0xdc00 || lo > 0xdfff {
					return "", false
				}
				j += 6
				sb.WriteRune(utf16.DecodeRune(rune(u), rune(lo)))
				continue
			}
			sb.WriteRune(rune(u))
		default:
			return "", false
		}
	}
	return "", false
}

// hex4 reads the four hex digits at b[i:].
func hex4(b []byte, i int) (uint16, bool) {
	if i+4 > len(b) {
		return 0, false
	}
	var v uint16
	for _, c := range b[i : i+4] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		v = v<<4 | uint16(c)
	}
	return v, true
}
