"""Record the CUPTI-JSONL kernel traces tests/data/h200_advisor_{eager,graph}.jsonl.gz.

Exactly what ran on the lent H200 on 2026-12-02 (driver 580.159.04, Python 3.12.3,
cupti-python 13.0.1, nvidia-cuda-cupti 13.0.85, the machine's torch), one process per scenario:

    python3 record_kernel_traces.py eager h200_advisor_eager.jsonl.gz
    python3 record_kernel_traces.py graph h200_advisor_graph.jsonl.gz

A standalone recorder (MEMORY2 + CONCURRENT_KERNEL straight from CUPTI, independent of the
probe), kept compact because it was sent inline in the device command.
* eager: a 2-layer bf16 transformer training step with AdamW, 12 steps, on the default stream;
  then 12 steps of 100 tiny add_ launches and a 20k-cycle sleep kernel on a side stream.
* graph: an MLP forward (3 linear, 2 GELU) warmed up on a side stream, captured in a CUDA graph,
  replayed 30 times on that side stream, then launched eagerly 30 times on the default stream.
"""
# ruff: noqa
import gzip,json,os,sys,threading
from cupti import cupti
S=sys.argv[1];L=[];K=threading.Lock()
def cb(rs):
 o=[]
 for r in rs:
  if r.kind==10:o.append({"k":"kern","start":r.start,"end":r.end,"name":r.name,"dev":r.device_id,"stream":r.stream_id&0xFFFFFFFF,"corr":r.correlation_id,"graph":r.graph_id,"node":r.graph_node_id})
  elif r.kind==49:o.append({"k":"mem","ts":r.timestamp,"op":r.memory_operation_type,"mk":r.memory_kind,"addr":r.address,"bytes":r.bytes,"dev":r.device_id,"stream":r.stream_id&0xFFFFFFFF,"corr":r.correlation_id,"is_async":int(bool(r.is_async))})
 with K:L.extend(o)
cupti.activity_register_callbacks(lambda:(8<<20,0),cb)
cupti.activity_enable(49);cupti.activity_enable(10)
import torch
nn=torch.nn;c="cuda"
if S=="eager":
 m=nn.TransformerEncoder(nn.TransformerEncoderLayer(512,8,2048,batch_first=True,dropout=0.0),2).cuda().to(torch.bfloat16)
 op=torch.optim.AdamW(m.parameters(),lr=1e-4)
 for _ in range(12):
  m(torch.randn(8,256,512,device=c,dtype=torch.bfloat16)).float().pow(2).mean().backward();op.step();op.zero_grad(set_to_none=True)
 s=torch.cuda.Stream();t=torch.zeros(1024,device=c)
 with torch.cuda.stream(s):
  for _ in range(12):
   for _ in range(100):t.add_(1.0)
   torch.cuda._sleep(20000)
else:
 m=nn.Sequential(nn.Linear(1024,4096),nn.GELU(),nn.Linear(4096,1024),nn.GELU(),nn.Linear(1024,1024)).cuda()
 x=torch.randn(256,1024,device=c);s=torch.cuda.Stream();s.wait_stream(torch.cuda.current_stream())
 with torch.cuda.stream(s):
  for _ in range(3):m(x)
 torch.cuda.current_stream().wait_stream(s);g=torch.cuda.CUDAGraph()
 with torch.cuda.graph(g):y=m(x)
 with torch.cuda.stream(s):
  for _ in range(30):g.replay()
 torch.cuda.synchronize()
 for _ in range(30):y=m(x)
torch.cuda.synchronize();cupti.activity_flush_all(1)
with gzip.open(sys.argv[2],"wt") as f:
 f.write(json.dumps({"k":"meta","format":"cupti-jsonl","version":1,"device":torch.cuda.get_device_name(),"source":"tests/gpu/record_kernel_traces.py","pid":os.getpid(),"scenario":S,"torch":torch.__version__})+"\n")
 for d in L:f.write(json.dumps(d)+"\n")
print(S,len(L),sum(d["k"]=="kern" for d in L))
