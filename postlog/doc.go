// Package postlog is the posterior log that replicas share: a single-partition Kafka topic whose
// records form a hash chain of posterior versions (docs/DESIGN.md, "The posterior log").
//
// Every replica plays the same records in the same order through the same pure acceptance rule
// (Chain.Offer), so every replica applies the same sequence of versions, whatever the timing:
//
//   - an entry is accepted when it names the current head as its parent (sequence number and
//     SHA-256 of the head's bytes as stored) and no earlier record did: the first valid successor
//     of each entry wins;
//   - a claim opens term head.term+1 for its writer; any other entry must carry the head's term
//     and the writer of that term's claim. The term is the fencing token, and the readers check
//     it: a writer that was paused or cut off while another claimed appends records that no
//     replica applies.
//
// An increment records the input offsets it covers (per partition, the next offset after it), its
// outcome, the update KL, the new last layer, and the SHA-256 of the posterior's weights (every
// layer's safetensors tensors) as bnn.Encode writes them. A follower never recomputes an update: it applies the recorded last
// layer to its posterior and checks the hash, so replicas agree bit for bit. Because the
// boundaries of increments are data, a replay or a restore reaches the same versions.
package postlog
