package h1client

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"strconv"
	"sync/atomic"
)

// Limits of a response head: an engine's is a few hundred bytes.
const (
	maxHeaderLines = 100
	maxInterim     = 10 // 1xx answers before the final one
)

// readResponse reads the response to req from c, past any 1xx: a 100 Continue is the
// trace's Got100Continue, the backend's acknowledgement that its handler took the request.
func (c *conn) readResponse(req *http.Request, trace *httptrace.ClientTrace) (*http.Response, error) {
	for i := 0; ; i++ {
		resp, err := parseHead(c.br)
		if err != nil {
			return nil, fmt.Errorf("read response head: %w", err)
		}
		if resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
			if i >= maxInterim {
				return nil, fmt.Errorf("read response head: %d interim answers", i+1)
			}
			if resp.StatusCode == http.StatusContinue && trace != nil && trace.Got100Continue != nil {
				trace.Got100Continue()
			}
			continue
		}
		resp.Request = req
		if err := frame(resp, req.Method, c.br); err != nil {
			return nil, err
		}
		return resp, nil
	}
}

// parseHead reads a status line and headers. It is the part of the client a backend's bytes
// reach first, hence FuzzParseHead.
func parseHead(br *bufio.Reader) (*http.Response, error) {
	line, err := readLine(br)
	if err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	resp := &http.Response{Header: make(http.Header, 6)}
	// HTTP/1.x SP 3DIGIT [SP reason]
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) || line[8] != ' ' || (line[7] != '0' && line[7] != '1') {
		return nil, fmt.Errorf("malformed status line %q", truncate(line))
	}
	resp.Proto, resp.ProtoMajor, resp.ProtoMinor = "HTTP/1.1", 1, 1
	if line[7] == '0' {
		resp.Proto, resp.ProtoMinor = "HTTP/1.0", 0
	}
	code := line[9:12]
	if code[0] < '1' || code[0] > '5' || code[1] < '0' || code[1] > '9' || code[2] < '0' || code[2] > '9' || (len(line) > 12 && line[12] != ' ') {
		return nil, fmt.Errorf("malformed status line %q", truncate(line))
	}
	resp.StatusCode = int(code[0]-'0')*100 + int(code[1]-'0')*10 + int(code[2]-'0')
	resp.Status = string(line[9:])
	for n := 0; ; n++ {
		line, err := readLine(br)
		if err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
		if len(line) == 0 {
			return resp, nil
		}
		if n >= maxHeaderLines {
			return nil, errTooLarge
		}
		i := bytes.IndexByte(line, ':')
		if i <= 0 {
			return nil, fmt.Errorf("malformed header line %q", truncate(line))
		}
		key := line[:i]
		for _, b := range key {
			if !isTokenByte(b) {
				return nil, fmt.Errorf("malformed header key %q", truncate(key))
			}
		}
		v := bytes.Trim(line[i+1:], " \t")
		for _, b := range v {
			if b < ' ' && b != '\t' || b == 0x7f {
				return nil, fmt.Errorf("malformed header value of %q", truncate(key))
			}
		}
		k, ok := commonKeys[string(key)]
		if !ok {
			k = textproto.CanonicalMIMEHeaderKey(string(key))
		}
		resp.Header[k] = append(resp.Header[k], string(v))
	}
}

// commonKeys spares the canonicalising of the header names engines send.
var commonKeys = func() map[string]string {
	m := map[string]string{}
	for _, k := range []string{"Content-Type", "Content-Length", "Transfer-Encoding", "Connection", "Date", "Server", "Cache-Control", "X-Request-Id", "Keep-Alive", "X-Accel-Buffering"} {
		m[k] = k
		m[string(bytes.ToLower([]byte(k)))] = k
	}
	return m
}()

// readLine reads one line, without its CRLF (or LF), that fits the reader's buffer.
func readLine(br *bufio.Reader) ([]byte, error) {
	line, err := br.ReadSlice('\n')
	if err == bufio.ErrBufferFull {
		return nil, errTooLarge
	}
	if err != nil {
		return nil, err
	}
	line = line[:len(line)-1]
	if n := len(line); n > 0 && line[n-1] == '\r' {
		line = line[:n-1]
	}
	return line, nil
}

func truncate(b []byte) []byte {
	if len(b) > 64 {
		return b[:64]
	}
	return b
}

func isTokenByte(c byte) bool {
	// RFC 9110 tchar.
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	switch c {
	case '!', '#', '$', '%', '&', '\'', '*', '+', '-', '.', '^', '_', '`', '|', '~':
		return true
	}
	return false
}

// frame decides how resp's body ends (RFC 9112 section 6.3) and gives it its Body.
func frame(resp *http.Response, method string, br *bufio.Reader) error {
	b := &body{br: br, n: -1}
	resp.Body = b
	resp.ContentLength = -1
	resp.Close = resp.ProtoMinor == 0 && !hasToken(resp.Header["Connection"], "keep-alive") || hasToken(resp.Header["Connection"], "close")
	b.reuse = !resp.Close
	te, cl := resp.Header["Transfer-Encoding"], resp.Header["Content-Length"]
	switch {
	case method == http.MethodHead || resp.StatusCode/100 == 1 || resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified:
		b.done = true
		if resp.StatusCode == http.StatusSwitchingProtocols {
			b.reuse = false // the connection speaks another protocol now
		}
		if len(cl) > 0 {
			if n, err := strconv.ParseInt(cl[0], 10, 64); err == nil && n >= 0 {
				resp.ContentLength = n
			}
		}
		if method != http.MethodHead {
			resp.ContentLength = 0
		}
	case len(te) > 0:
		if resp.ProtoMinor == 0 {
			// RFC 9112 section 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing.
			return errors.New("HTTP/1.0 response with Transfer-Encoding")
		}
		if len(te) != 1 || !equalFold(te[0], "chunked") {
			return fmt.Errorf("unsupported Transfer-Encoding %q", te)
		}
		if len(cl) > 0 {
			// Both framings at once is how responses are smuggled (RFC 9112 section 6.3).
			return errors.New("response has both Transfer-Encoding and Content-Length")
		}
		b.chunked = true
		b.n = 0
		resp.TransferEncoding = []string{"chunked"}
		resp.Header.Del("Transfer-Encoding")
	case len(cl) > 0:
		n, err := strconv.ParseInt(cl[0], 10, 64)
		if err != nil || n < 0 || cl[0][0] == '+' {
			return fmt.Errorf("malformed Content-Length %q", cl[0])
		}
		for _, v := range cl[1:] {
			if v != cl[0] {
				return fmt.Errorf("conflicting Content-Length %q", cl)
			}
		}
		resp.ContentLength, b.n = n, n
		b.done = n == 0
	default:
		// Until the server closes: the connection cannot be reused.
		b.reuse = false
		resp.Close = true
	}
	return nil
}

func hasToken(vs []string, token string) bool {
	for _, v := range vs {
		for len(v) > 0 {
			var t string
			t, v, _ = cut(v, ',')
			if equalFold(trimOWS(t), token) {
				return true
			}
		}
	}
	return false
}

func cut(s string, sep byte) (before, after string, found bool) {
	for i := 0; i < len(s); i++ {
		if s[i] == sep {
			return s[:i], s[i+1:], true
		}
	}
	return s, "", false
}

func trimOWS(s string) string {
	for len(s) > 0 && (s[0] == ' ' || s[0] == '\t') {
		s = s[1:]
	}
	for len(s) > 0 && (s[len(s)-1] == ' ' || s[len(s)-1] == '\t') {
		s = s[:len(s)-1]
	}
	return s
}

func equalFold(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := 0; i < len(a); i++ {
		x, y := a[i], b[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

// body is a response body read straight off its connection. A chunked body is decoded only
// as far as framing needs: one Read returns the data of every chunk already buffered, so a
// burst of SSE events reaches the relay in one read, and never waits for more than the first.
type body struct {
	br      *bufio.Reader
	chunked bool
	// n is what is left of a Content-Length body, or of the current chunk; -1 means until
	// the connection closes.
	n int64
	// crlf is set when a chunk's data has been read and its CRLF has not.
	crlf  bool
	done  bool // the body was read to its end
	reuse bool // the connection may carry another request once done
	err   error
	c     *conn
	ctx   context.Context
	stop  func() bool
	ended atomic.Bool // the connection was handed back or closed
}

func (b *body) Read(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	if b.done {
		return 0, io.EOF
	}
	if len(p) == 0 {
		return 0, nil
	}
	n, err := b.read(p)
	if err == io.EOF {
		b.done = true
		b.finish()
	} else if err != nil {
		if b.ctx != nil && b.ctx.Err() != nil {
			err = b.ctx.Err()
		}
		b.err = err
		b.close()
	}
	return n, err
}

func (b *body) read(p []byte) (int, error) {
	if !b.chunked {
		if b.n < 0 {
			return b.br.Read(p)
		}
		if int64(len(p)) > b.n {
			p = p[:b.n]
		}
		n, err := b.br.Read(p)
		b.n -= int64(n)
		if b.n == 0 {
			return n, io.EOF
		}
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return n, err
	}
	total := 0
	for total < len(p) {
		if b.n == 0 {
			if total > 0 && !b.nextBuffered() {
				break // the next chunk's head has not arrived: never wait with data in hand
			}
			last, err := b.chunkHead()
			if err != nil {
				return total, err
			}
			if last {
				return total, io.EOF
			}
		}
		want := int64(len(p) - total)
		if want > b.n {
			want = b.n
		}
		if total > 0 {
			if bf := int64(b.br.Buffered()); bf == 0 {
				break
			} else if want > bf {
				want = bf
			}
		}
		n, err := b.br.Read(p[total : total+int(want)])
		total += n
		b.n -= int64(n)
		if b.n == 0 {
			b.crlf = true
		}
		if err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return total, err
		}
	}
	return total, nil
}

// nextBuffered tells whether the next chunk's head (and, for the last chunk, the end of
// the body) is in the buffer already, so that reading it cannot block.
func (b *body) nextBuffered() bool {
	buf, _ := b.br.Peek(b.br.Buffered())
	if b.crlf {
		if len(buf) < 2 {
			return false
		}
		buf = buf[2:]
	}
	i := bytes.IndexByte(buf, '\n')
	if i < 0 {
		return false
	}
	if size := bytes.TrimLeft(buf[:i], "0"); len(size) == 0 || size[0] == ';' || size[0] == '\r' {
		// The last chunk: its trailer section must be here too (an empty one, usually).
		return bytes.Contains(buf[i:], []byte("\n\r\n")) || bytes.Contains(buf[i:], []byte("\n\n"))
	}
	return true
}

// chunkHead reads the CRLF ending the previous chunk, if due, and the next chunk's size
// line; for the last chunk it reads the trailers too, and reports it.
func (b *body) chunkHead() (last bool, err error) {
	if b.crlf {
		line, err := readLine(b.br)
		if err != nil {
			return false, unexpected(err)
		}
		if len(line) != 0 {
			return false, errors.New("malformed chunked encoding: data after a chunk")
		}
		b.crlf = false
	}
	line, err := readLine(b.br)
	if err != nil {
		return false, unexpected(err)
	}
	if i := bytes.IndexByte(line, ';'); i >= 0 {
		line = line[:i] // chunk extensions mean nothing here
	}
	line = bytes.TrimRight(line, " \t")
	if len(line) == 0 || len(line) > 16 {
		return false, errors.New("malformed chunk size")
	}
	var n int64
	for _, c := range line {
		var d byte
		switch {
		case '0' <= c && c <= '9':
			d = c - '0'
		case 'a' <= c && c <= 'f':
			d = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			d = c - 'A' + 10
		default:
			return false, errors.New("malformed chunk size")
		}
		n = n<<4 | int64(d)
	}
	if n < 0 {
		return false, errors.New("malformed chunk size")
	}
	if n > 0 {
		b.n = n
		return false, nil
	}
	for i := 0; ; i++ {
		line, err := readLine(b.br)
		if err != nil {
			return false, unexpected(err)
		}
		if len(line) == 0 {
			return true, nil
		}
		if i >= maxHeaderLines {
			return false, errTooLarge
		}
	}
}

func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

// finish hands the connection back once the body is done: to the pool when the server
// keeps it open and nothing else arrived on it, closed otherwise.
func (b *body) finish() {
	if b.c == nil || b.ended.Swap(true) {
		return
	}
	// stop is false when the context closed the connection already.
	if b.stop() && b.reuse && b.br.Buffered() == 0 {
		b.c.p.put(b.c)
		return
	}
	b.c.nc.Close()
}

// close drops the connection: the body was not read to its end.
func (b *body) close() {
	if b.c == nil || b.ended.Swap(true) {
		return
	}
	b.stop()
	b.c.nc.Close()
}

// Close ends the body; a body not read to its end closes its connection, since what is left
// of it would be read as the next answer.
func (b *body) Close() error {
	if b.done {
		b.finish()
	} else {
		if b.err == nil {
			b.err = errors.New("read on closed body")
		}
		b.close()
	}
	return nil
}

// Next returns the body's next bytes straight from the connection's read buffer, without a
// copy and without a buffer of the caller's: a stream then holds no relay buffer of its own
// while it waits for the next token. The bytes are valid until the next call. more tells
// that the following call will not wait (its bytes, or the body's end, have arrived), so a
// relay can write them before it flushes. At the end Next returns io.EOF.
func (b *body) Next() (p []byte, more bool, err error) {
	if b.err != nil {
		return nil, false, b.err
	}
	if b.done {
		return nil, false, io.EOF
	}
	p, more, err = b.next()
	if err == io.EOF {
		b.done = true
		b.finish()
	} else if err != nil {
		if b.ctx != nil && b.ctx.Err() != nil {
			err = b.ctx.Err()
		}
		b.err = err
		b.close()
	}
	return p, more, err
}

func (b *body) next() ([]byte, bool, error) {
	if !b.chunked && b.n == 0 {
		return nil, false, io.EOF
	}
	if b.chunked && b.n == 0 {
		last, err := b.chunkHead()
		if err != nil {
			return nil, false, err
		}
		if last {
			return nil, false, io.EOF
		}
	}
	if b.br.Buffered() == 0 {
		if _, err := b.br.Peek(1); err != nil {
			if err == io.EOF && b.n >= 0 {
				err = io.ErrUnexpectedEOF
			}
			return nil, false, err
		}
	}
	k := b.br.Buffered()
	if b.n >= 0 && int64(k) > b.n {
		k = int(b.n)
	}
	p, _ := b.br.Peek(k)
	b.br.Discard(k)
	if b.n < 0 {
		return p, b.br.Buffered() > 0, nil
	}
	b.n -= int64(k)
	if !b.chunked {
		if b.n == 0 {
			// The end is here: the caller learns it from the next call, with the bytes in hand.
			return p, true, nil
		}
		return p, b.br.Buffered() > 0, nil
	}
	if b.n > 0 {
		return p, b.br.Buffered() > 0, nil
	}
	b.crlf = true
	return b.coalesce(p)
}

// coalesce appends to p, in place, the data of the chunks that follow it complete in the
// read buffer, closing the gaps their heads leave: a burst of SSE events comes out as one
// slice, for one write to the client, and the chunk heads are all that is decoded. p ends a
// chunk and sits in the buffer just before the bytes still buffered. It stops before the
// last chunk, which the next call reads as the end.
func (b *body) coalesce(p []byte) ([]byte, bool, error) {
	rest, _ := b.br.Peek(b.br.Buffered())
	used := 0
	for {
		size, head, ok := chunkHeadIn(rest[used:])
		if !ok || size == 0 {
			break
		}
		data := rest[used+head:]
		k := min(int64(len(data)), size)
		// p and rest are one array: the chunk's data moves down over its head.
		p = append(p, data[:k]...)
		used += head + int(k)
		if k < size {
			b.crlf = false
			b.n = size - k
			break
		}
	}
	b.br.Discard(used)
	if b.n > 0 {
		return p, b.br.Buffered() > 0, nil
	}
	return p, b.nextBuffered(), nil
}

// chunkHeadIn parses the CRLF ending a chunk and the next chunk's size line at the start of
// buf: the size and the bytes they take, or ok false when they are not all there or are not
// plainly well formed (chunkHead then reads them, and names the error).
func chunkHeadIn(buf []byte) (size int64, n int, ok bool) {
	if len(buf) < 2 || buf[0] != '\r' || buf[1] != '\n' {
		return 0, 0, false
	}
	i := bytes.IndexByte(buf[2:], '\n')
	if i < 1 || buf[2+i-1] != '\r' {
		return 0, 0, false
	}
	line := buf[2 : 2+i-1]
	if len(line) == 0 || len(line) > 15 {
		return 0, 0, false
	}
	for _, c := range line {
		var d byte
		switch {
		case '0' <= c && c <= '9':
			d = c - '0'
		case 'a' <= c && c <= 'f':
			d = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			d = c - 'A' + 10
		default:
			return 0, 0, false // extensions, spaces: left to chunkHead
		}
		size = size<<4 | int64(d)
	}
	return size, 2 + i + 1, true
}
