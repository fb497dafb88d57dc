package h1client

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"sync/atomic"
)

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
	crlf bool
	// excess is the chunk heads' overhead so far (see overhead).
	excess int64
	// trailer is the response's Trailer, which the trailer section fills in.
	trailer *http.Header
	done    bool // the body was read to its end
	reuse   bool // the connection may carry another request once done
	err     error
	c       *conn
	ctx     context.Context
	stop    func() bool
	ended   atomic.Bool // the connection was handed back or closed
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

// nextBuffered tells whether the next chunk's head (and, for the last chunk, its trailer
// section) is in the buffer already, so that reading it cannot block.
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
	size, err := chunkSize(buf[:i+1])
	if err != nil || size > 0 {
		return true // chunkHead reads it, or fails, without waiting
	}
	rest := buf[i+1:]
	return bytes.HasPrefix(rest, []byte("\r\n")) || bytes.Contains(rest, []byte("\r\n\r\n"))
}

// chunkHead reads the CRLF ending the previous chunk, if due, and the next chunk's size
// line; for the last chunk it reads the trailer section too, and reports it.
func (b *body) chunkHead() (last bool, err error) {
	if b.crlf {
		p, err := b.br.Peek(2)
		if len(p) < 2 {
			return false, unexpected(err)
		}
		if p[0] != '\r' || p[1] != '\n' {
			return false, errors.New("malformed chunked encoding: no CRLF after a chunk's data")
		}
		b.br.Discard(2)
		b.crlf = false
	}
	line, err := readSlice(b.br, maxChunkLine)
	if err == errOverLimit {
		return false, errLineTooLong
	}
	if err != nil {
		return false, unexpected(err)
	}
	n, err := chunkSize(line)
	if err != nil {
		return false, err
	}
	if n == 0 {
		return true, b.readTrailer()
	}
	if err := b.overhead(len(line), n); err != nil {
		return false, err
	}
	b.n = n
	return false, nil
}

// chunkSize parses a chunk-size line, its CRLF included, as net/http's chunked reader does:
// CRLF and no other CR (RFC 9112 section 7.1; a bare LF ends no chunk line, erratum 7633),
// trailing spaces, then extensions, dropped, and at most 16 hex digits.
func chunkSize(line []byte) (int64, error) {
	if i := bytes.IndexByte(line, '\r'); i < 0 {
		return 0, errors.New("malformed chunked encoding: a chunk line ends with a bare LF")
	} else if i != len(line)-2 {
		return 0, errors.New("malformed chunked encoding: a CR inside a chunk line")
	}
	line = line[:len(line)-2]
	for len(line) > 0 && (line[len(line)-1] == ' ' || line[len(line)-1] == '\t') {
		line = line[:len(line)-1]
	}
	line, _, _ = bytes.Cut(line, []byte(";"))
	if len(line) == 0 {
		return 0, errors.New("malformed chunked encoding: empty chunk size")
	}
	if len(line) > 16 {
		return 0, errors.New("malformed chunked encoding: chunk size too large")
	}
	var n uint64
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
			return 0, errors.New("malformed chunked encoding: invalid byte in chunk size")
		}
		n = n<<4 | uint64(d)
	}
	if n > 1<<62 {
		// net/http takes up to 2^64-1 and then fails on the missing bytes; no stream is
		// that long, so it fails here at once.
		return 0, errors.New("malformed chunked encoding: chunk size too large")
	}
	return int64(n), nil
}

// overhead counts a chunk's head, of head bytes before its CRLF, against its size n, and
// fails when heads outweigh data as net/http's chunked reader has it: beyond 16 bytes per
// chunk plus twice its data, over maxChunkOverhead in all.
func (b *body) overhead(head int, n int64) error {
	b.excess += int64(head) - 16 - 2*min(n, maxChunkOverhead)
	b.excess = max(b.excess, 0)
	if b.excess > maxChunkOverhead {
		return errors.New("malformed chunked encoding: too much non-data")
	}
	return nil
}

// readTrailer reads the trailer section after the last chunk into the response's Trailer,
// as net/http does: bounded by the read buffer, which must hold its end.
func (b *body) readTrailer() error {
	p, err := b.br.Peek(2)
	if len(p) == 2 && p[0] == '\r' && p[1] == '\n' {
		b.br.Discard(2)
		return nil
	}
	if len(p) < 2 {
		return errTrailerEOF
	}
	if err != nil {
		return err
	}
	for n := 4; ; n++ {
		p, err := b.br.Peek(n)
		if bytes.HasSuffix(p, []byte("\r\n\r\n")) {
			break
		}
		if err != nil {
			return errors.New("trailer section over the read buffer")
		}
	}
	left := int64(b.br.Size())
	h, err := readHeader(b.br, &left)
	if err != nil {
		if err == io.ErrUnexpectedEOF {
			return errTrailerEOF
		}
		return fmt.Errorf("read trailer: %w", err)
	}
	if b.trailer != nil {
		if *b.trailer == nil {
			*b.trailer = h
		} else {
			maps.Copy(*b.trailer, h)
		}
	}
	return nil
}

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
		// A plain size line of at most 15 digits costs less than the 18 bytes a chunk of data
		// is allowed: it only lowers the overhead, and cannot fail.
		_ = b.overhead(head-2, size)
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
