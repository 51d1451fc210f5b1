package daemon

import (
	"cmp"
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

// backupStall is how long a client of GET /v1/backup may take to accept each chunk of the
// snapshot. The snapshot is one read transaction: a client that stops reading would hold it
// open, and with it every commit that grows the ledger's file (bbolt remaps it only once no
// read transaction holds the old mapping), and the daemon's stop.
const backupStall = 30 * time.Second

// stallWriter is a response body whose every Write must be taken within stall of its start.
type stallWriter struct {
	w     io.Writer
	rc    *http.ResponseController
	stall time.Duration
}

func (s stallWriter) Write(p []byte) (int, error) {
	s.rc.SetWriteDeadline(time.Now().Add(s.stall)) // an error means the writer has no deadlines
	return s.w.Write(p)
}

// handleBackup is GET /v1/backup: a consistent snapshot of the ledger (a complete bbolt file as
// of one transaction) streamed while ingestion goes on. Restore it with cfguard restore. A HEAD
// gets the headers only, without a snapshot taken.
func (a *api) handleBackup(w http.ResponseWriter, r *http.Request) {
	// The snapshot streams as long as the ledger takes to write, not within http.write_timeout,
	// but each chunk of it within backupStall.
	body := stallWriter{w: w, rc: http.NewResponseController(w), stall: cmp.Or(a.cfg.backupStall, backupStall)}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Content-Disposition", `attachment; filename="cfguard.db"`)
	h.Set("Trailer", trailerBackupTxID+", "+trailerBackupVersion+", "+trailerBackupError)
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return // a HEAD has no body: the snapshot is not read only to be thrown away
	}
	info, err := a.backup.Backup(r.Context(), body)
	if err != nil {
		h.Set(trailerBackupError, err.Error())
		return
	}
	h.Set(trailerBackupTxID, strconv.FormatUint(info.TxID, 10))
	h.Set(trailerBackupVersion, strconv.FormatUint(info.PosteriorVersion, 10))
}
