package api

import (
	"bytes"
	"encoding/json"
)

// Renamer puts the client's model name back into an answer an engine wrote with the served
// one: every `"model":"<served>"` member becomes `"model":"<client>"`. The patterns have
// unescaped quotes, so they never match inside a JSON string (generated text). Bytes that
// may begin a match split across two reads are held back until the next read shows; an SSE
// event ends in a blank line, so a stream is never held up by it.
type Renamer struct {
	// olds are the served name's member as engines may spell it: raw, as Python's and Rust's
	// JSON writers (vLLM's, SGLang's) put &, <, >, U+2028 and U+2029, and escaped, as Go's
	// does. One pattern when the two are the same.
	olds [][]byte
	new  []byte
	held []byte
}

func NewRenamer(served, client string) *Renamer {
	member := func(v []byte) []byte { return append([]byte(`"model":`), v...) }
	escaped, _ := json.Marshal(served)
	named, _ := json.Marshal(client)
	r := &Renamer{olds: [][]byte{member(escaped)}, new: member(named)}
	if raw := unescapeHTML(escaped); !bytes.Equal(raw, escaped) {
		r.olds = append(r.olds, member(raw))
	}
	return r
}

// htmlEscapes are the escapes Go's encoding/json writes that other JSON writers leave raw.
var htmlEscapes = map[string]string{`\u0026`: "&", `\u003c`: "<", `\u003e`: ">", `\u2028`: "\u2028", `\u2029`: "\u2029"}

// unescapeHTML is the JSON string s (as json.Marshal writes it) with htmlEscapes raw. Every
// backslash in s begins an escape, so they are walked one escape at a time: an escaped
// backslash followed by "u0026" is left alone.
func unescapeHTML(s []byte) []byte {
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		if s[i] != '\\' || i+1 >= len(s) {
			out = append(out, s[i])
			continue
		}
		if s[i+1] == 'u' && i+6 <= len(s) {
			if raw, ok := htmlEscapes[string(s[i:i+6])]; ok {
				out = append(out, raw...)
			} else {
				out = append(out, s[i:i+6]...)
			}
			i += 5
			continue
		}
		out = append(out, s[i:i+2]...)
		i++
	}
	return out
}

// rewrite returns p renamed, with what was held before it; nil r passes p as it is.
func (r *Renamer) rewrite(p []byte) []byte {
	if r == nil {
		return p
	}
	if len(r.held) == 0 && r.next(p) < 0 && r.overlap(p) == 0 {
		return p
	}
	data := append(r.held, p...)
	out := make([]byte, 0, len(data)+len(r.new))
	for {
		i := r.next(data)
		if i < 0 {
			break
		}
		out = append(out, data[:i]...)
		out = append(out, r.new...)
		data = data[i+len(r.match(data[i:])):]
	}
	k := r.overlap(data)
	out = append(out, data[:len(data)-k]...)
	r.held = append([]byte(nil), data[len(data)-k:]...)
	return out
}

// next is the index of the first pattern in p, or -1.
func (r *Renamer) next(p []byte) int {
	first := -1
	for _, old := range r.olds {
		if i := bytes.Index(p, old); i >= 0 && (first < 0 || i < first) {
			first = i
		}
	}
	return first
}

// match is the pattern p begins with.
func (r *Renamer) match(p []byte) []byte {
	for _, old := range r.olds {
		if bytes.HasPrefix(p, old) {
			return old
		}
	}
	return nil
}

// overlap is the length of the longest end of p that begins a pattern.
func (r *Renamer) overlap(p []byte) int {
	best := 0
	for _, old := range r.olds {
		k := min(len(p), len(old)-1)
		for ; k > best && !bytes.HasPrefix(old, p[len(p)-k:]); k-- {
		}
		best = max(best, k)
	}
	return best
}

// flush returns what is held at the answer's end.
func (r *Renamer) flush() []byte {
	if r == nil {
		return nil
	}
	h := r.held
	r.held = nil
	return h
}

// Pass is the renaming as a stage: the served model's name becomes the one the client asked
// for; what it held back for a name split across reads goes out when the answer ends, however.
func (r *Renamer) Pass(data []byte, end error) ([]byte, error) {
	data = r.rewrite(data)
	if end != nil {
		data = append(data, r.flush()...)
	}
	return data, end
}
