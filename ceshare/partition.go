package ceshare

// Partition returns the partition of the CE topic that holds CE id's requests, out of
// partitions, as Kafka's Java client partitions a keyed record (and kafka-go's
// Murmur2Balancer, librdkafka's "murmur2"), so that external tools agree:
//
//	partition = (murmur2(id) & 0x7fffffff) mod partitions
//
// It panics when partitions < 1 (a programmer's error: the count comes from a checked config).
func Partition(id string, partitions int) int {
	if partitions < 1 {
		panic("ceshare: Partition: partitions < 1")
	}
	return int((murmur2([]byte(id)) & 0x7fffffff) % uint32(partitions))
}

// murmur2 is the 32-bit MurmurHash2 of data with Kafka's seed 0x9747b28c, as
// org.apache.kafka.common.utils.Utils.murmur2 computes it.
func murmur2(data []byte) uint32 {
	const (
		seed uint32 = 0x9747b28c
		m    uint32 = 0x5bd1e995
		r           = 24
	)
	n := len(data)
	h := seed ^ uint32(n)
	for i := 0; i+4 <= n; i += 4 {
		k := uint32(data[i]) | uint32(data[i+1])<<8 | uint32(data[i+2])<<16 | uint32(data[i+3])<<24
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
	}
	tail := data[n&^3:]
	switch len(tail) {
	case 3:
		h ^= uint32(tail[2]) << 16
		fallthrough
	case 2:
		h ^= uint32(tail[1]) << 8
		fallthrough
	case 1:
		h ^= uint32(tail[0])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return h
}
