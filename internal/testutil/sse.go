package testutil

import (
	"bytes"
	"strconv"
)

// SSEDispatched parses an SSE stream as a client does (WHATWG event-stream: lines end in CRLF,
// LF or CR; a blank line dispatches the data lines gathered so far) and returns the data of
// every event dispatched.
func SSEDispatched(b []byte) []string {
	var out []string
	var data []string
	for len(b) > 0 {
		i := bytes.IndexAny(b, "\r\n")
		if i < 0 {
			break // an unterminated last line is never dispatched
		}
		line := b[:i]
		if b[i] == '\r' && i+1 < len(b) && b[i+1] == '\n' {
			i++
		}
		b = b[i+1:]
		switch {
		case len(line) == 0:
			if data != nil {
				out = append(out, string(bytes.Join(toBytes(data), []byte("\n"))))
			}
			data = nil
		case bytes.HasPrefix(line, []byte("data:")):
			v := bytes.TrimPrefix(line[5:], []byte(" "))
			data = append(data, string(v))
		}
	}
	return out
}

// Clip shortens b for a failure message.
func Clip(b []byte) string {
	if len(b) > 300 {
		return strconv.Quote(string(b[:150])) + "..." + strconv.Quote(string(b[len(b)-150:]))
	}
	return strconv.Quote(string(b))
}

func toBytes(ss []string) [][]byte {
	out := make([][]byte, len(ss))
	for i, s := range ss {
		out[i] = []byte(s)
	}
	return out
}
