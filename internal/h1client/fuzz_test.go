package h1client

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"
)

// FuzzParseHead feeds arbitrary backend bytes to the response parser and body framing, for a
// POST and for a HEAD, and holds the lean client to net/http's: no panic, no hang; Read and
// Next give the same body; and where net/http's transport takes the response (http.ReadResponse
// past 1xx answers, then its keep-alive rule) the lean client takes it alike: status, proto,
// header, Content-Length, chunked or not, Close, body, trailer, where the response ends in the
// input, and whether the connection could carry another request. A response one refuses and
// the other takes is a failure, but for the refusals response.go lists (documented, stricter
// than net/http where it is how responses are smuggled or split).
func FuzzParseHead(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"error\":\"x\"}",
		"HTTP/1.0 200 OK\r\n\r\nuntil close",
		"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\nx",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n0\r\nTrailer: x\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTrailer: X-Usage\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-Usage: 7\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
		"HTTP/1.1 204 No Content\r\n\r\n",
		"HTTP/1.1 204 No Content\r\nContent-Length: x\r\n\r\n",
		"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n2;x\r\nhi\r\nA\r\n0123456789\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3 ;x\r\nabc\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc\n0\n\n",
		"HTTP/1.1 200\r\ncontent-length: 1\r\n\r\nx",
		"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
		"HTTP/1.1 200 OK\r\nContent-Length: -0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length : 1\r\n\r\nx",
		"HTTP/1.1 200 OK\r\nX-A: one\r\n two\r\n\tthree\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nPragma: no-cache\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.5   200   OK\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 +20 OK\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\nraw",
		"HTTP/1.1 100 Continue\r\nTransfer-Encoding: gzip\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n",
		"HTTP/1.1 200 OK\r\nX-Long: " + strings.Repeat("a", 5000) + "\r\nContent-Length: 0\r\n\r\n",
	} {
		f.Add([]byte(s), false)
	}
	f.Add([]byte("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"), true)
	f.Add([]byte("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"), true)
	f.Fuzz(func(t *testing.T, data []byte, head bool) {
		method := http.MethodPost
		if head {
			method = http.MethodHead
		}
		mine, merr := readLean(data, method, readerSize, false)
		for _, size := range []int{readerSize, 16} {
			viaRead, rerr := readLean(data, method, size, false)
			viaNext, nerr := readLean(data, method, size, true)
			if (rerr == nil) != (nerr == nil) || rerr == nil && !reflect.DeepEqual(viaRead, viaNext) {
				t.Fatalf("%d-byte buffer: Read: %+v, %v; Next: %+v, %v", size, viaRead, rerr, viaNext, nerr)
			}
		}
		theirs, terr := readStdlib(data, method)
		switch {
		case merr != nil && terr != nil:
		case merr != nil:
			if why := stricter(merr); why != "" {
				t.Fatalf("lean refuses what net/http takes: %v\nnet/http: %+v", merr, theirs)
			}
		case terr != nil:
			t.Fatalf("lean takes what net/http refuses (%v): %+v", terr, mine)
		default:
			if !reflect.DeepEqual(mine, theirs) {
				t.Fatalf("lean:     %+v\nnet/http: %+v", mine, theirs)
			}
		}
	})
}

// stricter returns "" when err is one of the documented refusals of what net/http takes (see
// response.go), each of which the parser names only for input that net/http takes.
func stricter(err error) string {
	for _, refusal := range []error{errBothFramings, errTE10, errKeySpace, errVersion, errStatusCode, errSwitch} {
		if errors.Is(err, refusal) {
			return ""
		}
	}
	return "not a documented refusal"
}

// outcome is what a client makes of a response: what a caller sees, where the response
// ended, and whether the connection may be reused.
type outcome struct {
	Status        int
	StatusText    string
	Proto         string
	protoMajor    int
	ProtoMinor    int
	Header        http.Header
	ContentLength int64
	Chunked       bool
	Close         bool
	Body          string
	Trailer       http.Header
	Used          int // bytes of the input the response took
	Reuse         bool
}

func outcomeOf(resp *http.Response, body []byte) outcome {
	o := outcome{
		Status: resp.StatusCode, StatusText: resp.Status, Proto: resp.Proto, protoMajor: resp.ProtoMajor, ProtoMinor: resp.ProtoMinor,
		Header: resp.Header, ContentLength: resp.ContentLength, Chunked: len(resp.TransferEncoding) > 0, Close: resp.Close,
		Body: string(body), Trailer: resp.Trailer,
	}
	if len(o.Trailer) == 0 {
		o.Trailer = nil
	}
	return o
}

// readLean reads a response with h1client, its body with Read in small pieces (so that chunk
// boundaries fall everywhere) or with Next, from a reader of size bytes.
func readLean(data []byte, method string, size int, next bool) (outcome, error) {
	src := bytes.NewReader(data)
	br := bufio.NewReaderSize(src, size)
	resp, err := readResponse(br, method, DefaultMaxResponseHeaderBytes, nil)
	if err != nil {
		return outcome{}, err
	}
	b := resp.Body.(*body)
	var out bytes.Buffer
	if next {
		for {
			p, _, err := b.Next()
			out.Write(p)
			if err == io.EOF {
				break
			}
			if err != nil {
				return outcome{}, err
			}
		}
	} else if err := readSmall(b, &out); err != nil {
		return outcome{}, err
	}
	o := outcomeOf(resp, out.Bytes())
	o.Used = len(data) - br.Buffered() - src.Len()
	o.Reuse = b.reuse && br.Buffered() == 0
	return o, nil
}

// readStdlib reads a response as net/http's transport does: http.ReadResponse past interim
// answers (101 is final), the body to its end, and the connection kept when the response
// does not close it, is not 1xx, and nothing follows it (its read loop closes a connection
// that sends what nobody asked for).
func readStdlib(data []byte, method string) (outcome, error) {
	src := bytes.NewReader(data)
	br := bufio.NewReader(src)
	req := &http.Request{Method: method}
	var resp *http.Response
	for {
		var err error
		resp, err = http.ReadResponse(br, req)
		if err != nil {
			return outcome{}, err
		}
		if resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols || resp.StatusCode < 100 {
			break
		}
	}
	var out bytes.Buffer
	if err := readSmall(resp.Body, &out); err != nil {
		return outcomeOf(resp, nil), err
	}
	o := outcomeOf(resp, out.Bytes())
	o.Used = len(data) - br.Buffered() - src.Len()
	o.Reuse = !resp.Close && resp.StatusCode >= 200 && br.Buffered() == 0
	return o, nil
}

func readSmall(r io.ReadCloser, out *bytes.Buffer) error {
	defer r.Close()
	buf := make([]byte, 7)
	for {
		n, err := r.Read(buf)
		out.Write(buf[:n])
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

func (o outcome) String() string { return fmt.Sprintf("%#v", o) }
