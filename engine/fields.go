package engine

import (
	"bytes"
	"encoding/json"
	"errors"
	"iter"
	"unicode/utf8"
)

// ErrNullBody means a body is the JSON literal null, where an object was expected.
var ErrNullBody = errors.New("body is null, not a JSON object")

// Fields is a client's body parsed once: its bytes, validated as a JSON object, and where each
// top-level member sits in them. The rewrites copy the client's bytes and change only what
// they must, so fields the proxy does not know pass through untouched, byte for byte, and
// nothing is encoded again. A key that appears more than once counts by its last member, as
// encoding/json and Python's json read it; only that member is passed on.
type Fields struct {
	raw     []byte
	members []member
	// dup: some key appears more than once.
	dup bool
	// first holds the members of a body of a few, with the Fields in one allocation: a
	// request's body, and an engine's answer, has fewer.
	first [inlineMembers]member
}

// inlineMembers is how many members a Fields holds without a slice of its own.
const inlineMembers = 8

// member is one top-level `"key": value` of the body, as offsets into it.
type member struct {
	keyStart, keyEnd int    // the key between its quotes, as written
	key              string // the key as read, only when it is written with escapes or invalid UTF-8
	valStart, valEnd int
	// shadowed: a later member has the same key, so this one neither counts nor passes on.
	shadowed bool
}

// dupScanLimit is how many members are checked for duplicate keys one by one; past it, a map
// does it, so that a body of a million tiny members costs no more than linear time.
const dupScanLimit = 16

// ParseFields validates body as a JSON object and records its top-level members. It keeps
// body, which the caller must not modify afterwards. A body that is not valid JSON gets the
// error encoding/json gives (a *json.SyntaxError, ...), valid JSON that is no object a
// *json.UnmarshalTypeError, and null ErrNullBody.
func ParseFields(body []byte) (*Fields, error) {
	if !json.Valid(body) {
		var m map[string]json.RawMessage
		return nil, json.Unmarshal(body, &m) // fails: the error encoding/json gives for it
	}
	i := skipSpace(body, 0)
	if body[i] != '{' {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(body, &m); err != nil {
			return nil, err
		}
		return nil, ErrNullBody
	}
	f := &Fields{raw: body}
	// Valid JSON from here on: every index below stays inside body.
	i = skipSpace(body, i+1)
	if body[i] == '}' {
		return f, nil
	}
	f.members = f.first[:0]
	var seen map[string]int // key to index, once there are more than dupScanLimit members
	for {
		var m member
		keyEnd := stringEnd(body, i)
		m.keyStart, m.keyEnd = i+1, keyEnd-1
		if k := body[m.keyStart:m.keyEnd]; bytes.IndexByte(k, '\\') >= 0 || !utf8.Valid(k) {
			// Read as encoding/json reads it: escapes resolved, invalid UTF-8 as U+FFFD.
			if err := json.Unmarshal(body[i:keyEnd], &m.key); err != nil {
				return nil, err
			}
		}
		i = skipSpace(body, keyEnd) // at ':'
		i = skipSpace(body, i+1)    // at the value
		m.valStart, m.valEnd = i, valueEnd(body, i)
		if n := len(f.members); n < dupScanLimit {
			for j := range f.members {
				if p := &f.members[j]; !p.shadowed && f.sameKey(p, &m) {
					p.shadowed, f.dup = true, true
				}
			}
		} else {
			if seen == nil {
				seen = make(map[string]int, 2*dupScanLimit)
				for j := range f.members {
					if p := &f.members[j]; !p.shadowed {
						seen[f.keyOf(p)] = j
					}
				}
			}
			key := f.keyOf(&m)
			if j, ok := seen[key]; ok {
				f.members[j].shadowed, f.dup = true, true
			}
			seen[key] = n
		}
		f.members = append(f.members, m)
		i = skipSpace(body, m.valEnd)
		if body[i] == '}' {
			return f, nil
		}
		i = skipSpace(body, i+1) // past ','
	}
}

// keyOf is a member's key. It allocates only for a key written with escapes, which
// ParseFields unescaped already.
func (f *Fields) keyOf(m *member) string {
	if m.key != "" {
		return m.key
	}
	return string(f.raw[m.keyStart:m.keyEnd])
}

func (f *Fields) sameKey(a, b *member) bool {
	if a.key == "" && b.key == "" {
		return bytes.Equal(f.raw[a.keyStart:a.keyEnd], f.raw[b.keyStart:b.keyEnd])
	}
	return f.keyOf(a) == f.keyOf(b)
}

func (f *Fields) is(m *member, key string) bool {
	if m.key != "" {
		return m.key == key
	}
	return string(f.raw[m.keyStart:m.keyEnd]) == key // compared without allocating
}

// Field returns the raw JSON value of the member named key (its last one), and whether there
// is one. The value shares the body's bytes.
func (f *Fields) Field(key string) (json.RawMessage, bool) {
	for i := len(f.members) - 1; i >= 0; i-- {
		if m := &f.members[i]; !m.shadowed && f.is(m, key) {
			return f.raw[m.valStart:m.valEnd:m.valEnd], true
		}
	}
	return nil, false
}

// All yields every member's key and raw value in the body's order, duplicates included.
func (f *Fields) All() iter.Seq2[string, json.RawMessage] {
	return func(yield func(string, json.RawMessage) bool) {
		for i := range f.members {
			m := &f.members[i]
			if !yield(f.keyOf(m), f.raw[m.valStart:m.valEnd:m.valEnd]) {
				return
			}
		}
	}
}

// With is the object with member key set to the raw JSON value v, in place of any member of
// that name: a body with one field changed (a model alias resolved), its other bytes as they
// came.
func (f *Fields) With(key string, v json.RawMessage) (*Fields, error) {
	return ParseFields(f.rewrite([]string{key}, set{key, v}))
}

// Bytes is the object's JSON text, as it came or as a rewrite left it. The caller must not
// modify it.
func (f *Fields) Bytes() []byte { return f.raw }

// Len is the number of members, duplicates included.
func (f *Fields) Len() int { return len(f.members) }

// has reports whether any member is named one of keys.
func (f *Fields) has(keys ...string) bool {
	for i := range f.members {
		for _, k := range keys {
			if f.is(&f.members[i], k) {
				return true
			}
		}
	}
	return false
}

// set is a member the rewrite puts in, after the client's: a key and its raw JSON value.
type set struct {
	key string
	val []byte
}

// rewrite is the client's object without the members named in drop and without the earlier
// members of a duplicated key, followed by add (whose keys drop names too, where the client's
// member of that name must not stay). The bytes of every member kept are copied as they came.
func (f *Fields) rewrite(drop []string, add ...set) []byte {
	members := make([]Member, len(add))
	for i, a := range add {
		members[i] = Member{Key: a.key, Val: a.val}
	}
	return f.Edit(drop, members...)
}

// dropped reports whether member i stays out of a rewrite: its key is in drop, or a later
// member has the same key.
func (f *Fields) dropped(i int, drop []string) bool {
	m := &f.members[i]
	if m.shadowed {
		return true
	}
	for _, k := range drop {
		if f.is(m, k) {
			return true
		}
	}
	return false
}

func skipSpace(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// stringEnd returns the index just past the string that starts with the quote at b[i].
func stringEnd(b []byte, i int) int {
	j := i + 1
	for {
		k := bytes.IndexByte(b[j:], '"')
		if k < 0 {
			return len(b) // not valid JSON; ParseFields never gets here
		}
		q := j + k
		// The quote ends the string unless an odd number of backslashes escapes it.
		n := 0
		for p := q - 1; p > i && b[p] == '\\'; p-- {
			n++
		}
		if n%2 == 0 {
			return q + 1
		}
		j = q + 1
	}
}

// valueEnd returns the index just past the JSON value that starts at b[i].
func valueEnd(b []byte, i int) int {
	switch b[i] {
	case '"':
		return stringEnd(b, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				j = stringEnd(b, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1
				}
			}
		}
		return len(b)
	}
	j := i // a number, true, false or null
	for j < len(b) {
		switch b[j] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return j
		}
		j++
	}
	return j
}

// Member is one member of an object to set: its key and its raw JSON value.
type Member struct {
	Key string
	Val []byte
}

// Edit is the object's JSON text without the members named in drop, and with each of set's
// values in place of its member's, where that member stands; a member of set the object lacks
// is added at its end. Every other member's bytes are copied as they came. Answers the proxy
// passes on (an engine's stream events) are edited this way, so that what it does not touch
// reaches the client as the engine wrote it.
func (f *Fields) Edit(drop []string, set ...Member) []byte {
	out := make([]byte, 0, len(f.raw)+64)
	out = append(out, '{')
	first := true
	var done uint64 // which of set's members stood in the object (set is short)
	for i := range f.members {
		m := &f.members[i]
		if f.dropped(i, drop) {
			continue
		}
		if !first {
			out = append(out, ',')
		}
		first = false
		out = append(out, f.raw[m.keyStart-1:m.keyEnd+1]...)
		out = append(out, ':')
		val := f.raw[m.valStart:m.valEnd]
		for j := range set {
			if j < 64 && f.is(m, set[j].Key) {
				val, done = set[j].Val, done|1<<j
				break
			}
		}
		out = append(out, val...)
	}
	for j := range set {
		if j < 64 && done&(1<<j) != 0 {
			continue
		}
		if !first {
			out = append(out, ',')
		}
		first = false
		kb, _ := json.Marshal(set[j].Key)
		out = append(out, kb...)
		out = append(out, ':')
		out = append(out, set[j].Val...)
	}
	return append(out, '}')
}
