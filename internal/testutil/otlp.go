package testutil

import (
	"context"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// Span is a span as an OTLP collector received it.
type Span struct {
	Name     string
	TraceID  string // hex
	SpanID   string // hex
	ParentID string // hex; empty for a root
	Service  string // the resource's service.name
	Attrs    map[string]string
	Error    bool // status code ERROR
}

// OTLPReceiver is an OTLP trace collector on a loopback port, over HTTP (protobuf) or gRPC:
// what the OpenTelemetry exporters send it is decoded and kept for the test to read.
type OTLPReceiver struct {
	// Endpoint is the collector's base URL (http://127.0.0.1:port).
	Endpoint string

	mu    sync.Mutex
	spans []Span
}

// NewOTLPHTTPReceiver starts a collector that takes OTLP/HTTP protobuf on /v1/traces; it
// stops at the test's end.
func NewOTLPHTTPReceiver(t testing.TB) *OTLPReceiver {
	r := &OTLPReceiver{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path != "/v1/traces" || req.Method != http.MethodPost {
			http.NotFound(w, req)
			return
		}
		body, err := io.ReadAll(req.Body)
		var msg coltracepb.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(body, &msg)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.add(&msg)
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.Write(out)
	}))
	t.Cleanup(srv.Close)
	r.Endpoint = srv.URL
	return r
}

// NewOTLPGRPCReceiver starts a collector that takes OTLP over gRPC; it stops at the test's
// end.
func NewOTLPGRPCReceiver(t testing.TB) *OTLPReceiver {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	r := &OTLPReceiver{Endpoint: "http://" + ln.Addr().String()}
	gs := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(gs, grpcTraces{r: r})
	done := make(chan struct{})
	go func() {
		defer close(done)
		gs.Serve(ln)
	}()
	t.Cleanup(func() {
		gs.Stop()
		<-done
	})
	return r
}

type grpcTraces struct {
	coltracepb.UnimplementedTraceServiceServer
	r *OTLPReceiver
}

func (g grpcTraces) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	g.r.add(req)
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func (r *OTLPReceiver) add(msg *coltracepb.ExportTraceServiceRequest) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range msg.GetResourceSpans() {
		service := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.GetKey() == "service.name" {
				service = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				sp := Span{Name: s.GetName(), TraceID: hex.EncodeToString(s.GetTraceId()), SpanID: hex.EncodeToString(s.GetSpanId()),
					Service: service, Attrs: map[string]string{}, Error: s.GetStatus().GetCode() == 2}
				if p := s.GetParentSpanId(); len(p) > 0 {
					sp.ParentID = hex.EncodeToString(p)
				}
				for _, kv := range s.GetAttributes() {
					sp.Attrs[kv.GetKey()] = attrString(kv.GetValue())
				}
				r.spans = append(r.spans, sp)
			}
		}
	}
}

func attrString(v *commonpb.AnyValue) string {
	switch x := v.GetValue().(type) {
	case *commonpb.AnyValue_StringValue:
		return x.StringValue
	case *commonpb.AnyValue_BoolValue:
		if x.BoolValue {
			return "true"
		}
		return "false"
	case *commonpb.AnyValue_IntValue:
		return strconv.FormatInt(x.IntValue, 10)
	case *commonpb.AnyValue_DoubleValue:
		return strconv.FormatFloat(x.DoubleValue, 'g', -1, 64)
	}
	return ""
}

// Spans are the spans received so far.
func (r *OTLPReceiver) Spans() []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Span(nil), r.spans...)
}

// Trace is the spans of one trace, received so far.
func (r *OTLPReceiver) Trace(traceID string) []Span {
	var out []Span
	for _, s := range r.Spans() {
		if s.TraceID == traceID {
			out = append(out, s)
		}
	}
	return out
}
