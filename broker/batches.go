package broker

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/klauspost/compress/s2"
	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4/v4"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// MaxDecompressedBatchBytes bounds what one produced record batch may decompress to: the
// broker decompresses each batch to check its records (checkBatches), and a batch beyond this
// is refused (franz-go's consumers refuse to decompress more than 256 MiB as well).
const MaxDecompressedBatchBytes = 256 << 20

// checkBatches refuses a produce whose record batches the consumers could not read, as Kafka's
// log validator does at append: kfake checks a batch's header and CRC only, so a batch whose
// compressed data does not decompress, whose records do not parse, or whose count or offset
// deltas do not match its header would be stored, and every consumer's fetch at its offset
// would fail for good (cfguard's retries it forever: its partition is read no further). The
// checks are those of Kafka's DefaultRecordBatch and DefaultRecord: NumRecords records, each
// exactly its length, offset deltas 0, 1, ..., nothing after the last. Batches kfake refuses
// itself (not one whole batch, magic other than 2, a control batch, an unknown codec, a CRC
// mismatch) are left to it, and so is a produce whose body does not parse.
func checkBatches(r *kmsg.ProduceRequest) error {
	for _, t := range r.Topics {
		for _, p := range t.Partitions {
			if err := checkBatch(p.Records); err != nil {
				return fmt.Errorf("%w: produce to %s partition %d: %v", errInvalidRequest, t.Topic, p.Partition, err)
			}
		}
	}
	return nil
}

// checkBatch checks the one record batch b holds (see checkBatches).
func checkBatch(b []byte) error {
	var rb kmsg.RecordBatch
	if len(b) < 12 || rb.ReadFrom(b) != nil || int(rb.Length) != len(b)-12 || rb.Magic != 2 ||
		rb.Attributes&0x0020 != 0 || rb.Attributes&0x0007 > 4 {
		return nil // kfake refuses it
	}
	if rb.NumRecords < 0 {
		return fmt.Errorf("record batch of %d records", rb.NumRecords)
	}
	src, done, err := decompressor(rb.Attributes&0x0007, rb.Records)
	if err != nil {
		return err
	}
	defer done()
	lim := &io.LimitedReader{R: src, N: MaxDecompressedBatchBytes + 1}
	br := bufio.NewReader(lim)
	for i := range rb.NumRecords {
		if err := checkRecord(br, i); err != nil {
			if lim.N <= 0 {
				return fmt.Errorf("record batch decompresses to more than %d bytes", MaxDecompressedBatchBytes)
			}
			return fmt.Errorf("record %d of %d: %w", i, rb.NumRecords, err)
		}
	}
	switch _, err := br.ReadByte(); {
	case err == nil:
		return fmt.Errorf("record batch holds more than its %d records", rb.NumRecords)
	case lim.N <= 0:
		return fmt.Errorf("record batch decompresses to more than %d bytes", MaxDecompressedBatchBytes)
	case !errors.Is(err, io.EOF):
		return fmt.Errorf("after record %d: %w", rb.NumRecords, err)
	}
	return nil
}

// decompressor reads a batch's records compressed with codec. done releases it.
func decompressor(codec int16, data []byte) (io.Reader, func(), error) {
	nothing := func() {}
	switch codec {
	case 0:
		return bytes.NewReader(data), nothing, nil
	case 1:
		zr, err := gzip.NewReader(bytes.NewReader(data))
		if err != nil {
			return nil, nil, fmt.Errorf("gzip: %w", err)
		}
		return zr, nothing, nil
	case 2:
		return &snappyReader{src: data}, nothing, nil
	case 3:
		return lz4.NewReader(bytes.NewReader(data)), nothing, nil
	case 4:
		zr, err := zstd.NewReader(bytes.NewReader(data), zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true),
			zstd.WithDecoderMaxMemory(MaxDecompressedBatchBytes+1))
		if err != nil {
			return nil, nil, fmt.Errorf("zstd: %w", err)
		}
		return zr, zr.Close, nil
	}
	return nil, nil, fmt.Errorf("compression codec %d", codec)
}

// xerialMagic starts snappy data in the xerial framing Kafka's Java clients write: then an 8-byte
// version, then chunks of a 4-byte length and a snappy block.
var xerialMagic = []byte{0x82, 'S', 'N', 'A', 'P', 'P', 'Y', 0}

// snappyReader decodes Kafka's snappy data (one block, or xerial chunks) block by block, each
// only once its decoded length fits what is left of MaxDecompressedBatchBytes.
type snappyReader struct {
	src     []byte
	started bool
	xerial  bool
	out     []byte
	total   int
}

func (r *snappyReader) Read(p []byte) (int, error) {
	for len(r.out) == 0 {
		if err := r.next(); err != nil {
			return 0, err
		}
	}
	n := copy(p, r.out)
	r.out = r.out[n:]
	return n, nil
}

func (r *snappyReader) next() error {
	var block []byte
	switch {
	case !r.started:
		r.started = true
		if bytes.HasPrefix(r.src, xerialMagic) {
			if len(r.src) < 16 {
				return errors.New("snappy: truncated xerial header")
			}
			r.xerial, r.src = true, r.src[16:]
			return nil
		}
		block, r.src = r.src, nil
	case r.xerial && len(r.src) > 0:
		if len(r.src) < 4 {
			return errors.New("snappy: truncated xerial chunk length")
		}
		n := binary.BigEndian.Uint32(r.src)
		if uint64(n) > uint64(len(r.src)-4) {
			return errors.New("snappy: xerial chunk past the data's end")
		}
		block, r.src = r.src[4:4+n], r.src[4+n:]
	default:
		return io.EOF
	}
	n, err := s2.DecodedLen(block)
	if err != nil {
		return fmt.Errorf("snappy: %w", err)
	}
	if r.total+n > MaxDecompressedBatchBytes {
		return fmt.Errorf("snappy: record batch decompresses to more than %d bytes", MaxDecompressedBatchBytes)
	}
	out, err := s2.Decode(nil, block)
	if err != nil {
		return fmt.Errorf("snappy: %w", err)
	}
	r.total += len(out)
	r.out = out
	return nil
}

// recordReader reads one record's bytes: at most n more.
type recordReader struct {
	br *bufio.Reader
	n  int64
}

var errRecordShort = errors.New("a field runs past the record's length")

func (r *recordReader) ReadByte() (byte, error) {
	if r.n <= 0 {
		return 0, errRecordShort
	}
	c, err := r.br.ReadByte()
	if err != nil {
		return 0, unexpected(err)
	}
	r.n--
	return c, nil
}

func (r *recordReader) varint(what string) (int64, error) {
	v, err := binary.ReadVarint(r)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	return v, nil
}

// skip passes over n bytes (n < 0: a null, nothing).
func (r *recordReader) skip(n int64, what string) error {
	if n < 0 {
		return nil
	}
	if n > r.n {
		return fmt.Errorf("%s of %d bytes: %w", what, n, errRecordShort)
	}
	k, err := r.br.Discard(int(n))
	r.n -= int64(k)
	if err != nil {
		return fmt.Errorf("%s: %w", what, unexpected(err))
	}
	return nil
}

func unexpected(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// checkRecord reads record i of a batch from br: a varint length, then exactly that many bytes
// of attributes, timestamp delta, offset delta (i), key, value and headers.
func checkRecord(br *bufio.Reader, i int32) error {
	length, err := binary.ReadVarint(br)
	if err != nil {
		return fmt.Errorf("length: %w", unexpected(err))
	}
	if length < 0 || length > MaxDecompressedBatchBytes {
		return fmt.Errorf("length %d", length)
	}
	r := &recordReader{br: br, n: length}
	if _, err := r.ReadByte(); err != nil { // attributes
		return fmt.Errorf("attributes: %w", err)
	}
	if _, err := r.varint("timestamp delta"); err != nil {
		return err
	}
	delta, err := r.varint("offset delta")
	if err != nil {
		return err
	}
	if delta != int64(i) {
		return fmt.Errorf("offset delta %d, want %d", delta, i)
	}
	for _, what := range []string{"key", "value"} {
		n, err := r.varint(what + " length")
		if err != nil {
			return err
		}
		if err := r.skip(n, what); err != nil {
			return err
		}
	}
	headers, err := r.varint("header count")
	if err != nil {
		return err
	}
	if headers < 0 || headers > r.n {
		return fmt.Errorf("header count %d", headers)
	}
	for range headers {
		n, err := r.varint("header key length")
		if err != nil {
			return err
		}
		if n < 0 {
			return fmt.Errorf("header key length %d", n)
		}
		if err := r.skip(n, "header key"); err != nil {
			return err
		}
		if n, err = r.varint("header value length"); err != nil {
			return err
		}
		if err := r.skip(n, "header value"); err != nil {
			return err
		}
	}
	if r.n != 0 {
		return fmt.Errorf("%d bytes after its fields, within its length", r.n)
	}
	return nil
}
