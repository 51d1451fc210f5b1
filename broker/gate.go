package broker

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/twmb/franz-go/pkg/kmsg"
)

// Bounds the broker puts on what one request may ask of it (see gate).
const (
	// MaxRequestBytes is the largest produce request the broker reads (Kafka's
	// socket.request.max.bytes: franz-go's producer packs a batch of every partition in one
	// request of up to 100 MiB): a larger size prefix closes the connection before anything is
	// read for it.
	MaxRequestBytes = 100 << 20
	// MaxFetchRequestBytes is the largest fetch request the broker reads: one naming
	// MaxFetchPartitions partitions at the version franz-go sends (v13, 33 bytes a partition)
	// takes 4.3 MB.
	MaxFetchRequestBytes = 8 << 20
	// MaxOtherRequestBytes is the largest request of any other kind: a metadata or a group
	// request is far smaller, and its parse costs kfake several times its size.
	MaxOtherRequestBytes = 1 << 20
	// MaxBufferedBytes bounds the bytes of requests being read and parsed past their first
	// readChunk, across every connection (a request's bytes count until the connection's next
	// request starts, by when kfake has parsed and queued it): a request waits for room, up to
	// its RequestTimeout, as its bytes arrive. A size prefix alone holds nothing, and a request
	// of at most readChunk never waits.
	MaxBufferedBytes = 256 << 20
	// MaxPartitions bounds the partitions one CreateTopics or CreatePartitions may ask for, over
	// all its topics: kfake builds each partition it is asked for (about 400 bytes each).
	MaxPartitions = 10_000
	// MaxFetchPartitions bounds the partitions one fetch may name: two topics of the most
	// partitions Config.Partitions allows, which a client fetching every partition a broker
	// leads names at once.
	MaxFetchPartitions = 1 << 17
	// MaxFetchBytes bounds what one fetch returns: a request asking for more (in total or for
	// one partition) is answered with at most this much (and, as Kafka does, with the first
	// record batch whole when that alone is larger: a batch is at most its topic's
	// max.message.bytes, 1 MiB by default and 16 MiB for cfguard's posterior topic).
	MaxFetchBytes = 4 << 20
	// MaxFetchWait bounds how long a fetch waits at the broker for records: the broker keeps a
	// waiting fetch until it is answered, even when its connection has closed. kafka-go waits
	// 10 s by default.
	MaxFetchWait = 10_000 // milliseconds
)

// maxRequestBytes is the largest request of kind key the broker reads.
func maxRequestBytes(key kmsg.Key) int64 {
	switch key {
	case kmsg.Produce:
		return MaxRequestBytes
	case kmsg.Fetch:
		return MaxFetchRequestBytes
	}
	return MaxOtherRequestBytes
}

// checkSize refuses a request of kind key and size bytes (errOversized) over maxRequestBytes.
func checkSize(key kmsg.Key, size int64) error {
	if limit := maxRequestBytes(key); size > limit {
		return fmt.Errorf("%w: a %s request of %d bytes, over its bound (%d)", errOversized, kmsg.NameForKey(int16(key)), size, limit)
	}
	return nil
}

// errInvalidRequest marks a request the broker does not take (see gate); its connection is
// closed.
var errInvalidRequest = errors.New("broker: invalid request")

// header is the start of a request: Kafka's request header v1 or v2.
type header struct {
	key, version int16
	flexible     bool
	len          int // bytes of the header, tagged fields included
}

// readHeader parses the request header at the start of body.
func readHeader(body []byte) (header, kmsg.Request, error) {
	if len(body) < 10 {
		return header{}, nil, fmt.Errorf("%w: %d bytes, shorter than a request header", errInvalidRequest, len(body))
	}
	h := header{key: int16(binary.BigEndian.Uint16(body)), version: int16(binary.BigEndian.Uint16(body[2:]))}
	req := kmsg.RequestForKey(h.key)
	if req == nil {
		return h, nil, fmt.Errorf("%w: unknown API key %d", errInvalidRequest, h.key)
	}
	if shareGroupKeys[kmsg.Key(h.key)] {
		return h, nil, fmt.Errorf("%w: %s: the embedded broker serves no share groups", errInvalidRequest, kmsg.NameForKey(h.key))
	}
	// A client asks for ApiVersions at its newest version, and kfake answers one it does not
	// know with UNSUPPORTED_VERSION and its range, which the client then uses.
	if h.version < 0 || h.version > req.MaxVersion() && kmsg.Key(h.key) != kmsg.ApiVersions {
		return h, nil, fmt.Errorf("%w: %s version %d, outside 0..%d", errInvalidRequest, kmsg.NameForKey(h.key), h.version, req.MaxVersion())
	}
	req.SetVersion(h.version)
	h.flexible = req.IsFlexible()
	// key, version, correlation id, then the client id: a nullable string of int16 length.
	n := 8
	if l := int16(binary.BigEndian.Uint16(body[n:])); l > 0 {
		n += int(l)
	}
	n += 2
	if n > len(body) {
		return h, nil, fmt.Errorf("%w: client id past the request's end", errInvalidRequest)
	}
	if h.flexible { // tagged fields: a count, then (tag, size, bytes) each
		count, k := binary.Uvarint(body[n:])
		if k <= 0 {
			return h, nil, fmt.Errorf("%w: header tags", errInvalidRequest)
		}
		n += k
		for range count {
			_, k := binary.Uvarint(body[n:])
			if k <= 0 {
				return h, nil, fmt.Errorf("%w: header tags", errInvalidRequest)
			}
			n += k
			size, k := binary.Uvarint(body[n:])
			if k <= 0 || size > uint64(len(body)-n-k) {
				return h, nil, fmt.Errorf("%w: header tags", errInvalidRequest)
			}
			n += k + int(size)
		}
	}
	h.len = n
	return h, req, nil
}

// shareGroupKeys are the requests of share groups (KIP-932), which the broker refuses: no client
// of cfguard's uses them, and kfake keeps a share fetch parked for its whole wait after its
// connection closed.
var shareGroupKeys = map[kmsg.Key]bool{kmsg.ShareGroupHeartbeat: true, kmsg.ShareGroupDescribe: true, kmsg.ShareFetch: true,
	kmsg.ShareAcknowledge: true, kmsg.DescribeShareGroupOffsets: true, kmsg.AlterShareGroupOffsets: true, kmsg.DeleteShareGroupOffsets: true}

// verdict is what gate decided of a request.
type verdict struct {
	frame    []byte // the request as kfake is to read it: size prefix and body
	answered bool   // the broker writes a response (a produce with acks=0 gets none)
	clamped  bool   // a fetch asked for more than MaxFetchBytes or MaxFetchWait and was cut
}

// gate judges one whole request (body: the bytes after its size prefix) before kfake reads it.
// It refuses (errInvalidRequest, and the connection closes) what kfake would crash on or what
// makes it hold memory out of proportion to the request:
//
//   - an API key kmsg does not know (kfake dereferences the nil request it gets for one), a
//     version outside the key's range (but ApiVersions': kfake answers it), a header that does
//     not parse, a share-group request;
//   - a request over its kind's bound (maxRequestBytes);
//   - a produce, fetch, CreateTopics or CreatePartitions whose body does not parse;
//   - a produce of a record batch no consumer could read (checkBatches);
//   - a fetch naming one partition twice (kfake would return its records twice), or more than
//     MaxFetchPartitions partitions; a CreateTopics or CreatePartitions asking for more than
//     MaxPartitions partitions over its topics (kfake builds them all at once: 2^31 of them take
//     the process's memory).
//
// A fetch asking for more than MaxFetchBytes, or to wait longer than MaxFetchWait, is rewritten
// to ask for that much. Every other request goes through as it came.
func gate(frame []byte) (verdict, error) {
	body := frame[4:]
	h, req, err := readHeader(body)
	if err != nil {
		return verdict{}, err
	}
	if err := checkSize(kmsg.Key(h.key), int64(len(body))); err != nil {
		return verdict{}, err
	}
	v := verdict{frame: frame, answered: true}
	switch r := req.(type) {
	case *kmsg.ProduceRequest:
		if err := r.ReadFrom(body[h.len:]); err != nil {
			return verdict{}, fmt.Errorf("%w: produce v%d: %v", errInvalidRequest, h.version, err)
		}
		if err := checkBatches(r); err != nil {
			return verdict{}, err
		}
		v.answered = r.Acks != 0
	case *kmsg.FetchRequest:
		if err := r.ReadFrom(body[h.len:]); err != nil {
			return verdict{}, fmt.Errorf("%w: fetch v%d: %v", errInvalidRequest, h.version, err)
		}
		if err := distinctPartitions(r); err != nil {
			return verdict{}, err
		}
		if clampFetch(r) {
			v.clamped = true
			out := binary.BigEndian.AppendUint32(make([]byte, 0, len(frame)), 0)
			out = append(out, body[:h.len]...)
			out = r.AppendTo(out)
			binary.BigEndian.PutUint32(out, uint32(len(out)-4))
			v.frame = out
		}
	case *kmsg.CreateTopicsRequest:
		if err := r.ReadFrom(body[h.len:]); err != nil {
			return verdict{}, fmt.Errorf("%w: CreateTopics v%d: %v", errInvalidRequest, h.version, err)
		}
		total := 0
		for _, t := range r.Topics {
			total += max(int(t.NumPartitions), len(t.ReplicaAssignment), 1)
			if total > MaxPartitions {
				return verdict{}, fmt.Errorf("%w: a CreateTopics of more than MaxPartitions (%d) partitions", errInvalidRequest, MaxPartitions)
			}
		}
	case *kmsg.CreatePartitionsRequest:
		if err := r.ReadFrom(body[h.len:]); err != nil {
			return verdict{}, fmt.Errorf("%w: CreatePartitions v%d: %v", errInvalidRequest, h.version, err)
		}
		total := 0
		for _, t := range r.Topics {
			total += max(int(t.Count), 0)
			if total > MaxPartitions {
				return verdict{}, fmt.Errorf("%w: a CreatePartitions to more than MaxPartitions (%d) partitions", errInvalidRequest, MaxPartitions)
			}
		}
	}
	return v, nil
}

// distinctPartitions refuses a fetch that names one partition twice (by topic name, or by topic
// id from v13 on), or more than MaxFetchPartitions.
func distinctPartitions(r *kmsg.FetchRequest) error {
	type tp struct {
		topic string
		id    [16]byte
		p     int32
	}
	seen := map[tp]bool{}
	for _, t := range r.Topics {
		for _, p := range t.Partitions {
			if len(seen) == MaxFetchPartitions {
				return fmt.Errorf("%w: a fetch of more than MaxFetchPartitions (%d) partitions", errInvalidRequest, MaxFetchPartitions)
			}
			k := tp{t.Topic, t.TopicID, p.Partition}
			if seen[k] {
				return fmt.Errorf("%w: fetch names partition %d of topic %q%x twice", errInvalidRequest, p.Partition, t.Topic, t.TopicID)
			}
			seen[k] = true
		}
	}
	return nil
}

// clampFetch cuts r's byte limits to MaxFetchBytes and its wait to MaxFetchWait, and reports
// whether it changed anything.
func clampFetch(r *kmsg.FetchRequest) bool {
	changed := false
	cut := func(v *int32, limit int32) {
		if *v > limit {
			*v, changed = limit, true
		}
	}
	cut(&r.MaxWaitMillis, MaxFetchWait)
	cut(&r.MaxBytes, MaxFetchBytes)
	for i := range r.Topics {
		for j := range r.Topics[i].Partitions {
			cut(&r.Topics[i].Partitions[j].PartitionMaxBytes, MaxFetchBytes)
		}
	}
	return changed
}
