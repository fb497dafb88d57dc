package h1client

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

// engineAnswer is a vLLM-like streamed answer: uvicorn's head and n SSE events, a chunk each.
func engineAnswer(n int) []byte {
	var b strings.Builder
	b.WriteString("HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 19:00:00 GMT\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\nx-request-id: 0123456789abcdef\r\ntransfer-encoding: chunked\r\n\r\n")
	for i := range n {
		ev := fmt.Sprintf("data: {\"id\":\"cmpl-1\",\"choices\":[{\"index\":0,\"text\":\"tok%d\"}]}\n\n", i)
		fmt.Fprintf(&b, "%x\r\n%s\r\n", len(ev), ev)
	}
	b.WriteString("0\r\n\r\n")
	return []byte(b.String())
}

// BenchmarkReadResponse reads an engine's streamed answer, head and body (with Next, as the
// relay does), from memory: the parser's own cost, without a network.
func BenchmarkReadResponse(b *testing.B) {
	for _, n := range []int{1, 64} {
		data := engineAnswer(n)
		b.Run(fmt.Sprintf("%d events", n), func(b *testing.B) {
			src := bytes.NewReader(data)
			br := bufio.NewReaderSize(src, readerSize)
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				src.Reset(data)
				br.Reset(src)
				resp, err := readResponse(br, http.MethodPost, DefaultMaxResponseHeaderBytes, nil)
				if err != nil {
					b.Fatal(err)
				}
				body := resp.Body.(*body)
				for {
					_, _, err := body.Next()
					if err == io.EOF {
						break
					}
					if err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}
