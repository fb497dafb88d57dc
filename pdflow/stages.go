package pdflow

import "github.com/pdproxy/pdproxy/api"

// relayStages is the chain of stages of the exchange's answer, in their order: whole events
// for a stream that may go on elsewhere first, then the answer in its client's API, then its
// model's name.
func (x *Exchange) relayStages() []api.Stage {
	var chain []api.Stage
	if x.Out.Resume != nil {
		chain = append(chain, x.Out.Resume)
	}
	if x.Out.translate != nil {
		chain = append(chain, x.Out.translate)
	}
	if x.Names.Rename != nil {
		chain = append(chain, x.Names.Rename)
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
