package h1client

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"testing"
)

// FuzzParseHead feeds arbitrary backend bytes to the response parser and body framing: no
// panic, no hang, and where net/http's parser reads the same response, the same status
// and body.
func FuzzParseHead(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"error\":\"x\"}",
		"HTTP/1.0 200 OK\r\n\r\nuntil close",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n0\r\nTrailer: x\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
		"HTTP/1.1 204 No Content\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n2;x\r\nhi\r\nA\r\n0123456789\r\n0\r\n\r\n",
		"HTTP/1.1 200\r\ncontent-length: 1\r\n\r\nx",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		mine, merr := readAll(bufio.NewReaderSize(bytes.NewReader(data), 64), true, false)
		next, nerr := readAll(bufio.NewReaderSize(bytes.NewReader(data), 64), true, true)
		if (merr == nil) != (nerr == nil) || merr == nil && (mine.status != next.status || !bytes.Equal(mine.body, next.body)) {
			t.Errorf("Read: %d %q %v; Next: %d %q %v", mine.status, mine.body, merr, next.status, next.body, nerr)
		}
		theirs, terr := readAll(bufio.NewReader(bytes.NewReader(data)), false, false)
		if merr != nil || terr != nil {
			return
		}
		if mine.status != theirs.status || !bytes.Equal(mine.body, theirs.body) {
			t.Errorf("lean: %d %q; net/http: %d %q", mine.status, mine.body, theirs.status, theirs.body)
		}
	})
}

type parsed struct {
	status int
	body   []byte
}

// readAll reads a response with h1client (lean; with its Next when next) or net/http.
func readAll(br *bufio.Reader, lean, next bool) (parsed, error) {
	var resp *http.Response
	var err error
	if lean {
		for i := 0; ; i++ {
			resp, err = parseHead(br)
			if err != nil || resp.StatusCode >= 200 || resp.StatusCode == 101 || i > maxInterim {
				break
			}
		}
		if err == nil {
			err = frame(resp, http.MethodPost, br)
		}
	} else {
		for {
			resp, err = http.ReadResponse(br, &http.Request{Method: http.MethodPost})
			if err != nil || resp.StatusCode >= 200 || resp.StatusCode == 101 {
				break
			}
		}
	}
	if err != nil {
		return parsed{}, err
	}
	var out bytes.Buffer
	if next {
		b := resp.Body.(*body)
		for {
			p, _, err := b.Next()
			out.Write(p)
			if err == io.EOF {
				break
			}
			if err != nil {
				return parsed{}, err
			}
		}
		return parsed{resp.StatusCode, out.Bytes()}, nil
	}
	// Small reads, so that chunk boundaries fall everywhere.
	buf := make([]byte, 7)
	for {
		n, err := resp.Body.Read(buf)
		out.Write(buf[:n])
		if err == io.EOF {
			break
		}
		if err != nil {
			return parsed{}, err
		}
	}
	resp.Body.Close()
	return parsed{resp.StatusCode, out.Bytes()}, nil
}
