package daemon

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/cfguard/cfguard/ledger"
)

// backupSource is the ledger's online backup (*ledger.Ledger implements it).
type backupSource interface {
	Backup(ctx context.Context, w io.Writer) (ledger.Info, error)
}

// Trailers of GET /v1/backup. The body is streamed from one read transaction, so what the
// snapshot holds is known only once it is written; a client must still verify the file
// (cfguard backup does, with ledger.Verify) since a connection can break mid-way.
const (
	trailerBackupTxID    = "Cfguard-Backup-Txid"
	trailerBackupVersion = "Cfguard-Backup-Posterior-Version"
	trailerBackupError   = "Cfguard-Backup-Error"
)

// handleBackup is GET /v1/backup: a consistent snapshot of the ledger (a complete bbolt file as
// of one transaction) streamed while ingestion goes on. Restore it with cfguard restore.
func (a *api) handleBackup(w http.ResponseWriter, r *http.Request) {
	// The snapshot streams as long as the ledger takes to write: no http.write_timeout (an error
	// means the writer has no deadline to lift).
	http.NewResponseController(w).SetWriteDeadline(time.Time{})
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Content-Disposition", `attachment; filename="cfguard.db"`)
	h.Set("Trailer", trailerBackupTxID+", "+trailerBackupVersion+", "+trailerBackupError)
	w.WriteHeader(http.StatusOK)
	info, err := a.backup.Backup(r.Context(), w)
	if err != nil {
		h.Set(trailerBackupError, err.Error())
		return
	}
	h.Set(trailerBackupTxID, strconv.FormatUint(info.TxID, 10))
	h.Set(trailerBackupVersion, strconv.FormatUint(info.PosteriorVersion, 10))
}
