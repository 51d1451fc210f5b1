package replica

import (
	"net/http"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/stream"
)

// PeerTransport is the HTTP transport a replica, or a tool acting for one (cfguard new-epoch
// --head-from), asks the replicas' APIs with: http.DefaultTransport's settings, with the TLS of
// replication.peer_tls when it names a file (the peers' CAs, the client certificate presented
// to them). Errors name the key and the file.
func PeerTransport(rc config.Replication) (*http.Transport, error) {
	tlsCfg, err := stream.LoadTLSAt("replication.peer_tls", rc.PeerTLS.Files())
	if err != nil {
		return nil, err
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if tlsCfg != nil {
		tr.TLSClientConfig = tlsCfg
	}
	return tr, nil
}
