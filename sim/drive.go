package sim

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"
)

// drive submits r to the engine and hands each of its tokens to emit until
// the request ends. It owns the decoder's side of the KV transfer: it pulls
// when the scheduler has allocated r's blocks, notifies the prefiller, and
// reports the pull's end to the scheduler. Whatever way it returns (ctx
// done, emit failing, a panic(http.ErrAbortHandler) inside emit), a request
// the engine has not ended is aborted, and a decode whose prefiller was not
// told yet is notified, so the prefiller frees its hold (vLLM does the same
// for a do_remote_prefill request aborted before its KV arrived).
//
// An SGLang decode first waits for its room's KV (awaitRoom); an SGLang
// prefill holds back its last token until its room's transfer has ended,
// and a decode that ends before its transfer tells its prefiller nothing:
// with NIXL the room stays held until it is aborted.
//
// The error is nil once the last token was emitted (the caller then owns the
// abort if writing the response fails); otherwise an *apiError
// the engine answered with, errAborted, ctx's error or emit's.
func (e *Engine) drive(ctx context.Context, r *request, emit func(output) error) error {
	submit := e.submit
	switch {
	case r.kind == kindDecode && r.leg != nil:
		submit = func(r *request) error { return e.awaitRoom(ctx, r) }
	case r.kind == kindDecode && r.mc != nil:
		submit = func(r *request) error { return e.awaitTransfer(ctx, r) }
	}
	if err := submit(r); err != nil {
		return err
	}
	var (
		ended    bool    // the engine ended r: nothing to abort
		notified bool    // decode: the prefiller was told to free its hold
		gone     bool    // decode: the prefiller said it holds nothing
		failed   bool    // decode: the transfer failed (SGLang tells the prefiller)
		hold     *output // SGLang prefill: its last token, sent once the room is released
	)
	defer func() {
		if !ended {
			e.abortRequest(r)
		}
		if !r.readsKV() || notified || gone {
			return
		}
		switch {
		case r.leg == nil:
			e.notifyPrefiller(ctx, r.rid, r.remote, "")
		case failed:
			e.notifyPrefiller(ctx, r.rid, r.remote, outcomeFailed)
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-r.ready:
		}
		for _, o := range r.take() {
			switch o.kind {
			case outPull:
				if !r.readsKV() {
					// No full block to read (vLLM sends only full blocks):
					// nothing held for us, nobody to notify, compute the
					// prompt here.
					e.finishedReceiving(r, nil)
					continue
				}
				err := e.pullKV(ctx, r, o.pullFrom)
				gone = errors.Is(err, errKVNotHeld)
				// Once its read began, an SGLang decode that does not finish it
				// tells the prefiller, which may have seen the pull: a room in
				// transfer is freed by nothing else.
				failed = err != nil && !gone
				if err == nil {
					notified = true
					r.pulled.Store(true) // no lease left to renew
					e.notifyPrefiller(ctx, r.rid, r.remote, "")
				}
				if ctx.Err() != nil {
					return ctx.Err()
				}
				e.finishedReceiving(r, err)
			case outEnd:
				ended = true
				notified = notified || o.crashed // a dead engine tells nobody
				return o.err
			case outReleased:
				if hold == nil {
					continue // a hold this handler answered already
				}
				ended = true
				if o.err != nil {
					return o.err
				}
				if err := emit(*hold); err != nil {
					return err // the room is free: nothing left to abort
				}
				return nil
			case outToken:
				if o.held != nil && r.leg != nil {
					// SGLang answers the prefill's leg once its transfer is
					// done; till then an abort or a gone client frees the room.
					hold = &o
					continue
				}
				ended = o.finish != ""
				if err := emit(o); err != nil {
					// The client is gone before it got everything: abort, as
					// vLLM's server does on a disconnect. If the engine has
					// finished already this is the late, no-op abort of R1.
					ended = false
					return err
				}
				if ended {
					return nil
				}
			}
		}
	}
}

// pullKV reads the prefiller's blocks from the from'th on (those before
// are in this engine's prefix cache): the transfer time, then the pull call
// that verifies the blocks are still held at the end of the read. (The
// scheduler has waited for the handshake before ordering the pull.)
func (e *Engine) pullKV(ctx context.Context, r *request, from int) error {
	p := *r.remote
	p.RemoteBlockIDs = p.RemoteBlockIDs[from:]
	cost := time.Duration(len(p.RemoteBlockIDs)) * e.cfg.KVTransferTime
	if err := sleep(ctx, e.clock, cost); err != nil {
		return err
	}
	if r.transferFail {
		e.log.Warn("kv pull failed: injected fault", zap.String("request_id", r.rid), zap.String("prefiller", r.remote.RemoteEngineID))
		return errInjectedTransfer
	}
	if err := e.transport.pull(ctx, &p); err != nil {
		e.log.Warn("kv pull failed", zap.String("request_id", r.rid), zap.String("prefiller", r.remote.RemoteEngineID), zap.Error(err))
		return err
	}
	e.mu.Lock()
	e.counts.pulledBlocks += len(p.RemoteBlockIDs)
	e.mu.Unlock()
	return nil
}

// notifyPrefiller sends the read-complete notification for the decode rid
// that read (or will never read) the blocks kv names; outcome is what an
// SGLang decoder reports ("" read, outcomeFailed). It runs on a context
// detached from the request's on purpose: the request may be ending because
// its client left, and the prefiller must hear about it all the same.
func (e *Engine) notifyPrefiller(ctx context.Context, rid string, kv *kvTransferParams, outcome string) {
	nctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), notifyTimeout)
	defer cancel()
	if err := e.transport.notify(nctx, kv, outcome); err != nil {
		e.log.Warn("kv notify failed: the prefiller frees when the lease ends",
			zap.String("request_id", rid), zap.String("prefiller", kv.RemoteEngineID), zap.Error(err))
	}
}

// rejectDecode tells the prefiller that a decode it holds blocks for was
// rejected by this engine's serving layer (a 4xx after the body parsed), so
// that it frees them now rather than when the lease ends (vLLM #41269).
// It returns once the prefiller has the notification, before the 4xx goes
// out, so that whoever gets the 4xx may count on it.
func (e *Engine) rejectDecode(ctx context.Context, rid string, kv *kvTransferParams, why error) {
	kv = kv.heldFor(rid)
	if kv == nil {
		return
	}
	e.log.Info("decode rejected, prefiller notified to free its blocks",
		zap.String("request_id", rid), zap.String("prefiller", kv.RemoteEngineID), zap.Error(why))
	e.notifyPrefiller(ctx, rid, kv, "")
}
