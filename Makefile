.PHONY: install train test lint
install:
	python -m pip install -e '.[cpu,test]'
train:
	torchrun --nproc-per-node 4 -m isp_comm.train
test:
	python -m pytest -q -n 2
lint:
	ruff check . && ruff format --check .
