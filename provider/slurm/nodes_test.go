package slurm

import "testing"

// scontrol's line for a node, as Slurm 23.11 prints it: the OS value
// holds spaces, CfgTRES holds its own pairs.
const nodeLine = "NodeName=gpu-1 Arch=x86_64 CoresPerSocket=8 CPUAlloc=0 CPUEfctv=16 CPUTot=16 CPULoad=0.01 " +
	"AvailableFeatures=a100 ActiveFeatures=a100 Gres=gpu:a100:4 NodeAddr=gpu-1 NodeHostName=gpu-1 Version=23.11.4 " +
	"OS=Linux 6.1.0-25-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.106-3 (2024-08-26)  RealMemory=515000 AllocMem=0 " +
	"FreeMem=510000 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A " +
	"Partitions=gpu CfgTRES=cpu=16,mem=515000M,billing=16,gres/gpu=4 AllocTRES= CapWatts=n/a\n"

func TestParseNode(t *testing.T) {
	s, err := parseNode([]byte(nodeLine), "gpu-1")
	if err != nil {
		t.Fatal(err)
	}
	if s.Arch != "amd64" || s.CPUs != 16 || s.MemoryMiB != 515000 || s.OS != "Linux" || s.Kernel != "6.1.0-25-amd64" {
		t.Errorf("node system %+v", s)
	}
	if _, err := parseNode([]byte("Node gpu-9 not found\n"), "gpu-9"); err == nil {
		t.Error("a node scontrol does not know was read")
	}
}
