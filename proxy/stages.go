package proxy

import "github.com/pdproxy/pdproxy/api"

// relayStages is the chain of stages of the exchange's answer, in their order: whole events
// for a stream that may go on elsewhere first, then the answer in its client's API, then its
// model's name.
func (x *exchange) relayStages() []api.Stage {
	var chain []api.Stage
	if x.out.resume != nil {
		chain = append(chain, x.out.resume)
	}
	if x.out.translate != nil {
		chain = append(chain, x.out.translate)
	}
	if x.names.rename != nil {
		chain = append(chain, x.names.rename)
	}
	return chain
}

// Pass is the migration's filter as a stage: whole events only, an error event stopping the
// stream (errErrorEvent), so that a stream that goes on elsewhere leaves no half of one.
func (rs *resume) Pass(data []byte, end error) ([]byte, error) {
	data = rs.filter(data)
	if rs.errorEvent && end == nil {
		end = errErrorEvent
	}
	return data, end
}
