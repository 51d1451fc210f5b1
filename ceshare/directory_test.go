package ceshare

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/stream"
)

// The directory maps each partition to the member assigned it whose data authenticates. A
// member assigned nothing (every member, between generations) is not judged and logs nothing;
// one assigned partitions whose data does not authenticate owns none of them, with a WARN line.
// Members judges only the members that carry data.
func TestDirectoryJudgesOnlyMembersThatOwnPartitions(t *testing.T) {
	keys := testKeys()
	var logs bytes.Buffer
	d, err := NewDirectory(context.Background(), stream.ConnConfig{Brokers: []string{"127.0.0.1:1"}}, "g", "t", 4, keys,
		slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	signed, err := encodeMemberData(keys, memberData{Replica: "r1", URL: "http://127.0.0.1:8080"})
	if err != nil {
		t.Fatal(err)
	}
	assigned := func(ps ...int) kafka.DescribeGroupsResponseAssignments {
		return kafka.DescribeGroupsResponseAssignments{Topics: []kafka.GroupMemberTopic{{Topic: "t", Partitions: ps}, {Topic: "other", Partitions: []int{3}}}}
	}
	members := []kafka.DescribeGroupsResponseMember{
		{MemberID: "m-r1", MemberMetadata: kafka.DescribeGroupsResponseMemberMetadata{UserData: signed}, MemberAssignments: assigned(0, 1)},
		{MemberID: "m-rejoining"}, // between generations: no data, no assignment
		{MemberID: "m-other-topic", MemberAssignments: kafka.DescribeGroupsResponseAssignments{Topics: []kafka.GroupMemberTopic{{Topic: "other", Partitions: []int{2}}}}},
		{MemberID: "m-forged", MemberMetadata: kafka.DescribeGroupsResponseMemberMetadata{UserData: []byte(`{"data":"e30=","auth":"x"}`)}, MemberAssignments: assigned(2)},
	}
	owners := d.ownersOf(members)
	if len(owners) != 2 || owners[0].Replica != "r1" || owners[1].MemberID != "m-r1" {
		t.Errorf("owners %+v, want partitions 0 and 1 to r1 alone", owners)
	}
	for _, id := range []string{"m-rejoining", "m-other-topic", "m-r1"} {
		if strings.Contains(logs.String(), id) {
			t.Errorf("the log names %s, which owns nothing here or authenticates:\n%s", id, logs.String())
		}
	}
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "member=m-forged") {
		t.Errorf("no WARN line names m-forged, assigned a partition with data that does not authenticate:\n%s", logs.String())
	}

	// Members (the replica-id check) judges the same way: the members carrying data, those that
	// authenticate returned; a member between generations is not named.
	logs.Reset()
	d.refused = map[string]bool{}
	if got := d.membersOf(members); len(got) != 1 || got[0].MemberID != "m-r1" {
		t.Errorf("members %+v, want m-r1 alone", got)
	}
	for _, id := range []string{"m-rejoining", "m-other-topic", "m-r1"} {
		if strings.Contains(logs.String(), id) {
			t.Errorf("Members logs %s, which carries no data or authenticates:\n%s", id, logs.String())
		}
	}
	if !strings.Contains(logs.String(), "member=m-forged") {
		t.Errorf("Members: no WARN line names m-forged:\n%s", logs.String())
	}
}
