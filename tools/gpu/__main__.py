import sys

from tools.gpu.compile import main

sys.exit(main(sys.argv[1:]))
